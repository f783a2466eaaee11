"""Lengths and counts a NeMo-RL v0.7.0 config asks for that the run would cut without a word: responses past
`vllm_cfg.max_model_len` / `policy.max_total_sequence_length` after the longest prompt, sequences that fit
no packing bin, validation samples beyond whole batches. Each is an error naming the key asked, the key
that binds and a value that works (docs/architecture.md, "The planner's models").
"""

from __future__ import annotations

import math

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding, value

SEQ = "policy.max_total_sequence_length"
MODEL_LEN = "policy.generation.vllm_cfg.max_model_len"
MAX_NEW = "policy.generation.max_new_tokens"
PROMPT = "data.max_input_seq_length"


def length_rules(config: dict) -> list[Finding]:
    return [*_context_rules(config), *_response_rules(config), *_bin_rules(config), *_validation_rules(config)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def length_multiple(config: dict) -> int:
    """What max_total_sequence_length should be a multiple of: make_sequence_length_divisible_by, and with
    FP8 training the padded micro-batch (block x 2*CP x TP with sequence parallel)."""
    divisible = int(value(config, "policy.make_sequence_length_divisible_by") or 1)
    if not (bool(value(config, "policy.megatron_cfg.enabled")) and bool(value(config, "policy.megatron_cfg.fp8_cfg.enabled"))):
        return divisible
    tp = int(value(config, "policy.megatron_cfg.tensor_model_parallel_size"))
    cp = int(value(config, "policy.megatron_cfg.context_parallel_size"))
    sp = bool(value(config, "policy.megatron_cfg.sequence_parallel"))
    block = {"blockwise": 128, "mxfp8": 32}.get(value(config, "policy.megatron_cfg.fp8_cfg.fp8_recipe"), 16)
    return math.lcm(divisible, block * (2 * cp if cp > 1 else 1) * (tp if tp > 1 and sp else 1))


def context(config: dict) -> tuple[int, str]:
    """(tokens a sequence can reach, prompt included; the key that sets them)."""
    seq = int(value(config, SEQ))
    model_len = get(config, MODEL_LEN, seq)
    if model_len is not None and int(model_len) < seq:
        return int(model_len), MODEL_LEN
    return seq, SEQ


def _context_rules(config: dict) -> list[Finding]:
    seq = int(value(config, SEQ))
    model_len = get(config, MODEL_LEN, seq)
    if model_len is None or int(model_len) == seq:
        return []
    if int(model_len) > seq:
        return [Finding("error", MODEL_LEN, (
            f"{int(model_len):,} > {SEQ}={seq:,}: a response that runs past {seq:,} tokens fails NeMo-RL's rollout "
            f"(it asserts every sequence fits max_total_sequence_length) and no training micro-batch holds it: set "
            f"it to {seq} (${{policy.max_total_sequence_length}})"))]
    return [Finding("warning", MODEL_LEN, (
        f"{int(model_len):,} < {SEQ}={seq:,}: every sequence ends by {int(model_len):,} tokens, so the training "
        f"budget's last {seq - int(model_len):,} are never used: set it to {seq}, or lower {SEQ}"))]


def _response_rules(config: dict) -> list[Finding]:
    seq = int(value(config, SEQ))
    max_new = int(get(config, MAX_NEW, seq))
    if max_new == seq:
        return []  # NeMo-RL's default: until the context is full
    ctx, ctx_key = context(config)
    prompt = int(get(config, PROMPT, seq) or 0)
    if max_new + prompt <= ctx:
        return []
    room = ctx - prompt
    need = _round_up(max_new + prompt, length_multiple(config))
    cut = (f"no response gets past {ctx - 1:,} tokens" if max_new >= ctx else
           f"responses after prompts longer than {ctx - max_new:,} tokens are cut before it")
    fix = f"set {MAX_NEW}={room}" if room > 0 else f"lower {PROMPT} below {ctx:,}"
    raise_key = ctx_key if ctx_key == SEQ else f"{MODEL_LEN} (and {SEQ})"
    return [Finding("error", MAX_NEW, (
        f"{max_new:,} new tokens do not fit: a sequence ends at {ctx_key}={ctx:,} tokens, its prompt of up to "
        f"{prompt:,} ({PROMPT}) included, so {cut}: {fix} (what {ctx:,} leaves after the prompt), or raise "
        f"{raise_key} to {need} ({max_new:,} + {prompt:,}, rounded up to a multiple of {length_multiple(config):,})"))]


def longest_sequence(config: dict) -> int:
    """The most tokens one sequence (prompt + response) can reach."""
    ctx, _ = context(config)
    seq = int(value(config, SEQ))
    return min(ctx, int(get(config, PROMPT, seq) or 0) + int(get(config, MAX_NEW, seq)))


def _bin_rules(config: dict) -> list[Finding]:
    """A sequence longer than a micro-batch's token budget stops the run (partial_checks.py judges the
    bins against a partial_rollouts block's own lengths)."""
    if get(config, "partial_rollouts") is not None:
        return []
    seq = int(value(config, SEQ))
    if bool(value(config, "policy.sequence_packing.enabled")):
        section, pad_key = "policy.sequence_packing", "policy.make_sequence_length_divisible_by"
        pad = int(value(config, pad_key) or 1)
    elif bool(value(config, "policy.dynamic_batching.enabled")):
        section, pad_key = "policy.dynamic_batching", "policy.dynamic_batching.sequence_length_round"
        pad = int(get(config, pad_key, 64) or 1)
    else:
        return []
    longest = longest_sequence(config)
    padded = _round_up(longest, pad)
    out = []
    for key, rows in (("train_mb_tokens", "train_micro_batch_size"), ("logprob_mb_tokens", "logprob_batch_size")):
        per_row = int(get(config, f"policy.{rows}", value(config, "policy.train_micro_batch_size")) or 1)
        budget = int(get(config, f"{section}.{key}", seq * per_row))
        if budget < padded:
            out.append(Finding("error", f"{section}.{key}", (
                f"{budget:,} tokens, but one sequence may reach {longest:,} tokens ({padded:,} padded to {pad_key}="
                f"{pad}): NeMo-RL stops at the first one ('exceeds bin capacity'): set it to at least {padded}")))
    return out


def _validation_rules(config: dict) -> list[Finding]:
    runs = int(get(config, "grpo.val_period", 0) or 0) > 0 or any(
        bool(get(config, f"grpo.{k}", False)) for k in ("val_at_start", "val_at_end"))
    samples, batch = get(config, "grpo.max_val_samples"), get(config, "grpo.val_batch_size")
    if not runs or not samples or not batch or int(samples) % int(batch) == 0:
        return []
    samples, batch = int(samples), int(batch)
    whole = samples // batch * batch
    divisor = max(d for d in range(1, batch + 1) if samples % d == 0)
    done = "no validation sample at all" if whole == 0 else f"{whole:,} of them"
    return [Finding("error", "grpo.max_val_samples", (
        f"{samples:,} with grpo.val_batch_size={batch:,}: NeMo-RL validates max_val_samples // val_batch_size whole "
        f"batches, {done}: set max_val_samples={max(whole, batch)} or val_batch_size={divisor}"))]
