"""The `grpo.async_grpo` block against the rest of a NeMo-RL v0.7.0 config: what `async_grpo_train`
asserts before its loop starts (the async vLLM engine, importance-sampling correction, non-colocated
generation), what our own hooks cannot run with it (partial rollouts wrap the synchronous loop's
rollout; the async loop generates inside NeMo-RL's `AsyncTrajectoryCollector`), and settings that do
nothing. Each finding names the key and the fix; `check_config` runs them, so the driver's pre-flight
refuses an async config that cannot run before Ray starts."""

from __future__ import annotations

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding, value


def async_rules(config: dict) -> list[Finding]:
    block = get(config, "grpo.async_grpo") or {}
    in_flight = bool(block.get("in_flight_weight_updates", False))
    async_engine = bool(value(config, "policy.generation.vllm_cfg.async_engine"))
    if not bool(value(config, "grpo.async_grpo.enabled")):
        if in_flight:
            return [Finding(
                "warning", "grpo.async_grpo.in_flight_weight_updates",
                "does nothing without grpo.async_grpo.enabled=true (the synchronous loop updates the weights "
                "between steps): set it false, or enable async GRPO",
            )]
        return []
    f: list[Finding] = []
    if not bool(value(config, "loss_fn.use_importance_sampling_correction")):
        f.append(Finding("error", "loss_fn.use_importance_sampling_correction",
                         "async GRPO trains on stale rollouts (async_grpo_train asserts it): set it true"))
    if bool(value(config, "policy.generation.colocated.enabled")):
        f.append(Finding(
            "error", "policy.generation.colocated.enabled",
            "async GRPO needs dedicated generation GPUs (async_grpo_train refuses colocated inference): set it "
            "false and give policy.generation.colocated.resources the generation GPUs or nodes",
        ))
    if not async_engine:
        needs = "async GRPO and its in_flight_weight_updates need" if in_flight else "async GRPO needs"
        f.append(Finding("error", "policy.generation.vllm_cfg.async_engine",
                         f"{needs} the async vLLM engine: set policy.generation.vllm_cfg.async_engine=true"))
    if get(config, "partial_rollouts") is not None:
        f.append(Finding(
            "error", "partial_rollouts",
            "partial rollouts run inside the synchronous loop (grpo_train's rollout); async GRPO generates in "
            "NeMo-RL's AsyncTrajectoryCollector, which the hook does not reach: remove the partial_rollouts "
            "block, or set grpo.async_grpo.enabled=false",
        ))
    age = block.get("max_trajectory_age_steps", 1)
    if not isinstance(age, int) or isinstance(age, bool) or age < 1:
        f.append(Finding("error", "grpo.async_grpo.max_trajectory_age_steps",
                         f"{age!r}: the policy versions a trajectory may lag, an int >= 1 (e.g. 1)"))
    elif age > 1 and not in_flight:
        f.append(Finding(
            "warning", "grpo.async_grpo.in_flight_weight_updates",
            f"max_trajectory_age_steps={age} without in-flight weight updates: every update still waits for "
            "the generations in flight, so the older trajectories bring staleness and little speed: set it true "
            "(NeMo-RL warns the same)",
        ))
    if bool(block.get("recompute_kv_cache_after_weight_updates", False)) and not in_flight:
        f.append(Finding(
            "warning", "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
            "does nothing without in_flight_weight_updates (no generation crosses an update): set it false",
        ))
    return f
