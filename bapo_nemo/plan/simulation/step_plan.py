"""One GRPO step of a config on a cluster plan, end to end: the response-length model, the simulated
generation (plan/simulation/generation_check.py) with and without partial rollouts, the log-prob and training time
and the save (plan/simulation/step_time.py), BAPO's share of it, and the partial-rollout state a checkpoint carries.
An async GRPO config's step is its own setting simulated on its split (plan/simulation/async_generation.py).
`bapo-nemo check` prints it; the signal lead is sized from the config's own choice."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bapo_nemo.plan.rules.cluster_plan import ClusterPlan
from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.simulation.async_generation import (
    REPLAY_BYTES_PER_TOKEN,
    AsyncSetting,
    AsyncStats,
    transfer_seconds,
)
from bapo_nemo.plan.simulation.engine_sim import GenerationModelError
from bapo_nemo.plan.simulation.generation import RolloutShape, StepStats
from bapo_nemo.plan.simulation.generation_check import (
    DRIVER_BYTES_PER_TOKEN,
    SIMULATED_STEPS,
    STATE_JSON_BYTES_PER_TOKEN,
    GenerationReport,
    generation_report,
    generation_warnings,
    kv_cache_errors,
    partial_setting,
    rollout_shape_for,
)
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.plan.simulation.simulations import response_moments, simulate_async
from bapo_nemo.plan.simulation.step_time import (
    DEFAULT_FS_WRITE_GBPS_PER_NODE,
    StepTimeEstimate,
    estimate_step_time,
    shape_from_config,
    train_cost,
)

ASYNC_SIMULATED_STEPS = 8


@dataclass
class StepPlan:
    shape: RolloutShape
    lengths: LengthModel
    report: GenerationReport
    without: StepTimeEstimate  # no partial rollouts
    configured: StepTimeEstimate | None  # the config's partial_rollouts block
    best: StepTimeEstimate | None  # the sweep's best budget
    tokens_per_sample: float  # prompt + response, mean
    own_async: AsyncStats | None = None  # an async GRPO config: its setting on its split
    async_estimate: StepTimeEstimate | None = None  # and its step

    @property
    def estimate(self) -> StepTimeEstimate:
        """The config's own choice: what its job will run."""
        return self.async_estimate or self.configured or self.without

    @property
    def state_tokens(self) -> float:
        """Response tokens in flight after a step, checkpointed in partial_rollouts.json."""
        return self.report.configured.in_flight_tokens if self.report.configured else 0.0


def length_model(lengths: LengthModel, config: dict, prompt_tokens: int, mean_length_share: float | None) -> LengthModel:
    """`--mean-length-share S`: every response at S x max_total_sequence_length minus the prompt."""
    if mean_length_share is None:
        return lengths
    seq = int(get(config, "policy.max_total_sequence_length", 512))
    return replace(lengths, empirical=(max(1, round(mean_length_share * seq) - prompt_tokens),))


def plan_step(
    config: dict,
    plan: ClusterPlan,
    model: ModelShape,
    gpu: str,
    nodes: int,
    lengths: LengthModel,
    prompt_tokens: int,
    fs_write_gbps: float = DEFAULT_FS_WRITE_GBPS_PER_NODE,
    sweep: bool = True,
    steps: int = SIMULATED_STEPS,
    async_steps: int = ASYNC_SIMULATED_STEPS,
) -> tuple[StepPlan | None, list[Finding]]:
    """`steps` / `async_steps`: simulated steps averaged (check's defaults; the bench averages more)."""
    shape = rollout_shape_for(config, plan.generation_gpus or plan.train_gpus, model, gpu, prompt_tokens)
    findings = kv_cache_errors(shape)
    if findings:
        return None, findings
    partial = partial_setting(config)
    sweep = sweep and AsyncSetting.of_config(config) is None
    try:
        report = generation_report(
            shape, lengths, partial[0] if partial else None, partial[1] if partial else 1, sweep, steps
        )
    except GenerationModelError as exc:
        return None, [Finding("error", "policy.generation.vllm_cfg.gpu_memory_utilization", str(exc))]
    mean, mean_squared = response_moments(shape, lengths)
    step = shape_from_config(config, plan.train_gpus, mean, mean_squared)

    def estimate(stats: StepStats, validation_s: float, state_tokens: float = 0.0) -> StepTimeEstimate:
        return estimate_step_time(
            model, step, gpu, nodes, report.generation_s(stats), validation_s, fs_write_gbps,
            extra_save_bytes=state_tokens * STATE_JSON_BYTES_PER_TOKEN,
        )

    without = estimate(report.without, report.validation_without_s)
    setting = AsyncSetting.of_config(config)
    if setting is not None and plan.generation_gpus:
        try:
            own = simulate_async(shape, lengths, setting, train_cost(model, step, gpu), transfer_seconds(model),
                                 steps=async_steps)
        except GenerationModelError as exc:
            return None, [Finding("error", "policy.generation.vllm_cfg.gpu_memory_utilization", str(exc))]
        # The trainer's step: its own passes, plus what it waits for (NeMo-RL's exposed generation) and the
        # weight update; each checkpoint also writes the replay buffer.
        passes = without.logprob_s + without.train_s
        async_estimate = estimate_step_time(
            model, step, gpu, nodes, max(0.0, own.step_s - passes), report.validation_without_s, fs_write_gbps,
            extra_save_bytes=own.buffer_tokens * REPLAY_BYTES_PER_TOKEN,
        )
        result = StepPlan(shape, lengths, report, without, None, None, mean, own, async_estimate)
        return result, []  # partial rollouts do not run with async GRPO (async_checks.py)
    configured = None
    if report.configured is not None:
        configured = estimate(report.configured, report.validation_configured_s, report.configured.in_flight_tokens)
    best = None
    if report.best_budget is not None:
        best = estimate(report.sweep[report.best_budget], report.validation_configured_s or report.validation_without_s)
    result = StepPlan(shape, lengths, report, without, configured, best, mean)
    return result, generation_warnings(report, without.logprob_s + without.train_s)


def driver_state_gb(tokens: float) -> tuple[float, float]:
    """(partial_rollouts.json per checkpoint, driver memory) in GB for this many in-flight tokens."""
    return tokens * STATE_JSON_BYTES_PER_TOKEN / 1e9, tokens * DRIVER_BYTES_PER_TOKEN / 1e9
