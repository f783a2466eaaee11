"""What `bapo-nemo check` reports about generation: tokens/s and the step with and without partial rollouts,
the token budget that minimises the step, and a warning when the config's is far from it (generation.py
simulates). Steps compare as expected response tokens per step / simulated tokens/s (plus training, equal
either way), so sampling noise does not pick the budget. The sweep tries cap/8, cap/4, cap/2 (powers of
two), keeping the config's pool and setting `max_resumptions` to ceil(cap / budget) - 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.memory import GB, GPU_CAPACITY_GB
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.simulation.engine_sim import DEFAULT_MAX_NUM_SEQS, engine_for
from bapo_nemo.plan.simulation.generation import RolloutShape, StepStats
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.plan.simulation.simulations import (
    expected_response_tokens,
    simulate_partial,
    simulate_validation,
    simulate_without_partial,
)
from bapo_nemo.rollout.config import PartialRolloutConfig, PartialRolloutConfigError

# A config's choice is "far" from the best when its step is this much longer (10%).
FAR_FROM_BEST = 1.10
# The presets' bar for turning partial rollouts on (docs/cluster.md): a step at least 15% shorter.
PAYS = 0.85
# What the hook keeps per in-flight token (measured on PartialRolloutManager, tests/unit/test_plan_generation.py):
# partial_rollouts.json in every checkpoint (a token id and a float log-prob as JSON), and the driver's
# Python lists.
STATE_JSON_BYTES_PER_TOKEN = 29
DRIVER_BYTES_PER_TOKEN = 70
SIMULATED_STEPS = 4


def rollout_shape_for(
    config: dict, generation_gpus: int, model: ModelShape, gpu: str, prompt_tokens: int
) -> RolloutShape:
    """The engines and the step's rollout batch of a config (generation GPUs: the training ones when
    colocated)."""
    vllm = "policy.generation.vllm_cfg"
    g = int(get(config, f"{vllm}.tensor_parallel_size", 1)) * int(get(config, f"{vllm}.pipeline_parallel_size", 1))
    seq = int(get(config, "policy.max_total_sequence_length", 512))
    kwargs = get(config, "policy.generation.vllm_kwargs") or {}
    engine = engine_for(
        model,
        gpu,
        GPU_CAPACITY_GB[gpu] * GB,
        g,
        1.0 if get(config, f"{vllm}.precision", "bfloat16") == "fp8" else 2.0,
        1.0 if str(get(config, f"{vllm}.kv_cache_dtype", "auto")).startswith("fp8") else 2.0,
        float(get(config, f"{vllm}.gpu_memory_utilization", 0.6)),
        int(kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS),
    )
    val_period = int(get(config, "grpo.val_period", 10) or 0)
    return RolloutShape(
        engines=max(1, generation_gpus // g),
        engine=engine,
        prompts_per_step=int(get(config, "grpo.num_prompts_per_step", 32)),
        group_size=int(get(config, "grpo.num_generations_per_prompt", 16)),
        prompt_tokens=prompt_tokens,
        max_new_tokens=int(get(config, "policy.generation.max_new_tokens", seq)),
        max_model_len=int(get(config, f"{vllm}.max_model_len", seq) or seq),
        validation_samples=int(get(config, "grpo.max_val_samples", 256) or 0) if val_period > 0 else 0,
        validation_batch=int(get(config, "grpo.val_batch_size", 256) or 0),
    )


def partial_setting(config: dict) -> tuple[PartialRolloutConfig, int] | None:
    """The config's `partial_rollouts:` block and its prefill_batches; None without one (or with an
    invalid one: check_config names its errors)."""
    block = get(config, "partial_rollouts")
    if not isinstance(block, dict):
        return None
    block = dict(block)
    prefill = block.pop("prefill_batches", 1)
    try:
        return PartialRolloutConfig.parse(block), int(prefill)
    except (PartialRolloutConfigError, TypeError, ValueError):
        return None


def covering(config: PartialRolloutConfig, budget: int, cap: int) -> PartialRolloutConfig:
    """The block with another budget and the resumption cap that keeps the response cap."""
    return config.model_copy(update={"token_budget": budget, "max_resumptions": max(0, math.ceil(cap / budget) - 1)})


def budget_grid(cap: int, configured: int | None = None) -> list[int]:
    """cap/8, cap/4 and cap/2, each rounded up to a power of two, and the config's budget; all below the
    cap."""
    grid = {1 << max(0, math.ceil(cap / k) - 1).bit_length() for k in (8, 4, 2)}
    if configured is not None:
        grid.add(configured)
    return sorted(b for b in grid if 0 < b < cap)


@dataclass
class GenerationReport:
    shape: RolloutShape
    response_tokens: float  # expected per response
    without: StepStats
    validation_without_s: float
    prefill_batches: int
    configured: StepStats | None = None  # the config's partial_rollouts block
    configured_budget: int | None = None
    validation_configured_s: float = 0.0
    sweep: dict[int, StepStats] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> float:
        return self.response_tokens * self.shape.prompts_per_step * self.shape.group_size

    def generation_s(self, stats: StepStats) -> float:
        return self.tokens_per_step / stats.tokens_per_s

    @property
    def best_budget(self) -> int | None:
        return min(self.sweep, key=lambda b: self.generation_s(self.sweep[b])) if self.sweep else None

    def speedup(self, stats: StepStats) -> float:
        return stats.tokens_per_s / self.without.tokens_per_s


def generation_report(
    shape: RolloutShape,
    lengths: LengthModel,
    partial: PartialRolloutConfig | None,
    prefill_batches: int = 1,
    sweep: bool = True,
    steps: int = SIMULATED_STEPS,
) -> GenerationReport:
    """Simulate the config without partial rollouts, with its block (if any) and over the budget grid."""
    report = GenerationReport(
        shape=shape,
        response_tokens=expected_response_tokens(shape, lengths),
        without=simulate_without_partial(shape, lengths, steps=steps),
        validation_without_s=simulate_validation(shape, lengths),
        prefill_batches=prefill_batches,
    )
    cap = (partial.max_response_tokens if partial else None) or shape.max_new_tokens
    base = partial or PartialRolloutConfig(token_budget=cap, stale_segments="keep")
    if partial is not None:
        report.configured = simulate_partial(shape, lengths, partial, prefill_batches, steps=steps)
        report.configured_budget = partial.token_budget
        report.validation_configured_s = simulate_validation(shape, lengths, partial)
    if sweep:
        for budget in budget_grid(min(cap, shape.response_cap), partial.token_budget if partial else None):
            report.sweep[budget] = simulate_partial(shape, lengths, covering(base, budget, cap), prefill_batches, steps=steps)
    return report


def kv_cache_errors(shape: RolloutShape) -> list[Finding]:
    """vLLM refuses to start when max_model_len is more than one engine's KV cache holds."""
    if shape.max_model_len <= shape.engine.kv_tokens:
        return []
    message = (
        f"each vLLM engine's KV cache holds {shape.engine.kv_tokens:,} tokens, fewer than max_model_len="
        f"{shape.max_model_len:,}: vLLM refuses to start; raise gpu_memory_utilization or "
        "vllm_cfg.tensor_parallel_size, or lower max_model_len"
    )
    return [Finding("error", "policy.generation.vllm_cfg.gpu_memory_utilization", message)]


def generation_warnings(report: GenerationReport, rest_s: float) -> list[Finding]:
    """Warnings when the config's choice is far from the best step the model finds. `rest_s`:
    the log-prob and training time, the same with or without partial rollouts."""
    without = report.generation_s(report.without) + rest_s
    best = report.best_budget
    if best is None:
        return []
    best_step = report.generation_s(report.sweep[best]) + rest_s
    pool = f"prefill_batches {report.prefill_batches}"
    if report.configured is None:
        if best_step <= PAYS * without:
            message = (
                f"partial rollouts with token_budget {best} ({pool}) would shorten the step from "
                f"{without:.0f}s to {best_step:.0f}s ({report.speedup(report.sweep[best]):.2f}x generated "
                "tokens/s): add a partial_rollouts: block (configs/bapo_32b_64k.yaml has one)"
            )
            return [Finding("warning", "partial_rollouts", message)]
        return []
    configured = report.generation_s(report.configured) + rest_s
    out = []
    if configured >= FAR_FROM_BEST * without:
        message = (
            f"partial rollouts make the step longer: {configured:.0f}s against {without:.0f}s without them "
            f"({report.speedup(report.configured):.2f}x generated tokens/s): remove the block"
        )
        out.append(Finding("warning", "partial_rollouts", message))
    elif configured >= FAR_FROM_BEST * best_step:
        message = (
            f"{report.configured_budget} gives a {configured:.0f}s step; token_budget {best} gives "
            f"{best_step:.0f}s ({pool}, max_resumptions {math.ceil(report.shape.response_cap / best) - 1})"
        )
        out.append(Finding("warning", "partial_rollouts.token_budget", message))
    return out
