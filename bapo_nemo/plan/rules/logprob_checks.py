"""Whether vLLM's log-probs and the trainer's are of the same distribution.

The trainer scores each token after temperature, top-k and top-p (both NeMo-RL releases). NeMo-RL v0.7.0
always starts vLLM with `logprobs_mode="processed_logprobs"`, the same; NeMo-RL main made it a key,
`policy.generation.vllm_cfg.logprobs_mode`, and without it vLLM answers with its default, the raw log-probs
(before any of them). Sampling that changes the distribution then makes every behaviour log-prob wrong:
the ones partial rollouts keep for their resumed segments and the ratios BAPO clips
(tests/nemo_rl/test_vllm_engine.py measured a gap of 1.5 nats at temperature 0.8).
"""

from __future__ import annotations

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.schema import known_keys

MODE_KEY = "policy.generation.vllm_cfg.logprobs_mode"


def sampling_changes(config: dict) -> list[str]:
    """The generation settings under which raw and processed log-probs differ, as `key=value`."""
    changes = []
    temperature = get(config, "policy.generation.temperature", 1.0)
    if temperature is not None and float(temperature) != 1.0:
        changes.append(f"policy.generation.temperature={temperature}")
    top_p = get(config, "policy.generation.top_p", 1.0)
    if top_p is not None and float(top_p) < 1.0:
        changes.append(f"policy.generation.top_p={top_p}")
    top_k = get(config, "policy.generation.top_k", None)
    if top_k is not None and int(top_k) not in (-1, 0):
        changes.append(f"policy.generation.top_k={top_k}")
    return changes


def logprob_mode_rules(config: dict, nemo_rl: str) -> list[Finding]:
    if MODE_KEY not in known_keys(nemo_rl):  # a release that always asks vLLM for processed log-probs
        return []
    mode = get(config, MODE_KEY, None)
    changes = sampling_changes(config)
    if mode == "processed_logprobs" or not changes:
        return []
    said = "raw_logprobs" if mode == "raw_logprobs" else "not set, so vLLM's default, raw_logprobs"
    return [Finding(
        "error", MODE_KEY,
        f"{said}: vLLM would return each sampled token's log-prob before {', '.join(changes)} while the "
        "trainer scores it after them, so the behaviour log-probs partial rollouts keep and the ratios BAPO "
        "clips would be of another distribution; set it to processed_logprobs (as NeMo-RL's own GRPO "
        "examples do)",
    )]
