"""The `partial_rollouts:` block against the rest of a NeMo-RL v0.7.0 config: the hook's own rules
(bapo_nemo.rollout.config) and the lengths it asks for, each finding naming the key that binds and the fix.
As the hook applies them, a response grows by at most `token_budget` per step, for at most
`max_resumptions + 1` segments up to the response cap, after a prompt of up to `data.max_input_seq_length`;
prompt + response must fit `policy.max_total_sequence_length`, vLLM's `max_model_len` and a packing bin.
"""

from __future__ import annotations

import math

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding, value
from bapo_nemo.plan.rules.length_checks import context
from bapo_nemo.rollout.config import (
    PartialRolloutConfig,
    PartialRolloutConfigError,
    check_partial_rollout_config,
)


def partial_rollout_rules(config: dict) -> list[Finding]:
    block = get(config, "partial_rollouts")
    if block is None:
        return []
    if not isinstance(block, dict):
        return [Finding("error", "partial_rollouts", "must be a mapping of settings, e.g. {token_budget: 16384}")]
    block = dict(block)
    prefill = block.pop("prefill_batches", 1)  # a driver-side option
    findings = []
    if not isinstance(prefill, int) or isinstance(prefill, bool) or prefill < 0:
        findings.append(
            Finding(
                "error",
                "partial_rollouts.prefill_batches",
                f"{prefill!r}: extra dataloader batches in flight, an int >= 0 (e.g. 1)",
            )
        )
    try:
        partial = PartialRolloutConfig.parse(block)
    except PartialRolloutConfigError as exc:
        return findings + [Finding("error", "partial_rollouts", str(exc))]
    findings += [Finding("error", "partial_rollouts", p) for p in check_partial_rollout_config(config, partial)]
    return findings + _length_rules(config, partial)


def _length_rules(config: dict, partial: PartialRolloutConfig) -> list[Finding]:
    seq = int(value(config, "policy.max_total_sequence_length"))
    max_new = int(get(config, "policy.generation.max_new_tokens", seq))
    prompt = int(get(config, "data.max_input_seq_length", 0) or 0)
    cap_key = "partial_rollouts.max_response_tokens" if partial.max_response_tokens else "policy.generation.max_new_tokens"
    cap = partial.max_response_tokens or max_new
    budget = partial.token_budget
    f: list[Finding] = []
    if budget > cap:
        f.append(
            Finding(
                "error",
                "partial_rollouts.token_budget",
                f"{budget} is larger than the response cap {cap} ({cap_key}): no response is ever cut, so the "
                f"block only adds the pool's staleness; use a budget below the cap (e.g. {cap // 2}) or remove "
                "the block",
            )
        )
        return f
    if budget == cap:
        f.append(
            Finding(
                "warning",
                "partial_rollouts.token_budget",
                f"equals the response cap {cap} ({cap_key}): no response is ever cut; use a smaller budget",
            )
        )
    segments_limit = budget * partial.max_segments
    longest = min(cap, segments_limit)
    limit_key = "partial_rollouts.max_resumptions" if segments_limit < cap else cap_key
    ctx, ctx_key = context(config)
    if prompt + longest > ctx:
        f.append(
            Finding(
                "error",
                limit_key,
                f"a response may grow to {longest} tokens (token_budget {budget} x {partial.max_segments} "
                f"segments, response cap {cap}), which after a {prompt}-token prompt (data.max_input_seq_length) "
                f"exceeds {ctx_key}={ctx}: lower it to at most {ctx - prompt} tokens",
            )
        )
    if bool(value(config, "policy.sequence_packing.enabled")):
        f += _packing_bin_rules(config, partial, prompt, longest, cap, limit_key, ctx)
    if segments_limit < cap and limit_key.endswith("max_resumptions") and not any(x.level == "error" for x in f):
        keep = math.ceil(cap / budget) - 1
        f.append(
            Finding(
                "warning",
                "partial_rollouts.max_resumptions",
                f"{partial.max_resumptions}: responses are cut at {segments_limit} tokens ({partial.max_segments} "
                f"segments of {budget}), before the response cap {cap} that applies without the block; set it "
                f"to {keep} to keep the cap",
            )
        )
    return f


def _packing_bin_rules(
    config: dict, partial: PartialRolloutConfig, prompt: int, longest: int, cap: int, limit_key: str, ctx: int
) -> list[Finding]:
    """One segment, and the longest response the block allows, against each packing bin."""
    seq = int(value(config, "policy.max_total_sequence_length"))
    budget = partial.token_budget
    f: list[Finding] = []
    mbs = int(value(config, "policy.train_micro_batch_size"))
    for key in ("train_mb_tokens", "logprob_mb_tokens"):
        bin_tokens = int(get(config, f"policy.sequence_packing.{key}", seq * mbs))
        if prompt + budget > bin_tokens:
            f.append(
                Finding(
                    "error",
                    "partial_rollouts.token_budget",
                    f"{budget} new tokens after a {prompt}-token prompt (data.max_input_seq_length) do not fit "
                    f"the packing bin policy.sequence_packing.{key}={bin_tokens}: use a budget of at most "
                    f"{bin_tokens - prompt}, or raise the bin",
                )
            )
        elif prompt + longest > bin_tokens and prompt + longest <= ctx:  # else the rule above said it
            f.append(
                Finding(
                    "error",
                    limit_key,
                    f"the longest response the block allows ({longest} tokens: budget {budget} x "
                    f"{partial.max_segments} segments, cap {cap}) after a {prompt}-token prompt does not fit "
                    f"the packing bin policy.sequence_packing.{key}={bin_tokens}: lower it, or raise the bin",
                )
            )
    return f
