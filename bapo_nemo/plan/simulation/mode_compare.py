"""Sync GRPO, sync with partial rollouts and async GRPO side by side for one config on one cluster, each at
its best split of GPUs, in response tokens trained per hour and the per-token age of what is trained.
`bapo-nemo check` and `bench/generation.py` print it; docs/cluster.md section 8 reads it. Sync modes use
the config's own colocated layout; async modes search splits of whole nodes between generation and
training that the memory model fits (docs/architecture.md, "The planner's models").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from bapo_nemo.plan.rules.cluster_plan import ClusterPlan, plan_cluster
from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding, value
from bapo_nemo.plan.rules.memory import estimate
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.simulation.async_generation import AsyncSetting, AsyncStats, transfer_seconds
from bapo_nemo.plan.simulation.engine_sim import GenerationModelError
from bapo_nemo.plan.simulation.generation_check import rollout_shape_for
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.plan.simulation.simulations import response_moments, simulate_async
from bapo_nemo.plan.simulation.step_plan import ASYNC_SIMULATED_STEPS, StepPlan
from bapo_nemo.plan.simulation.step_time import shape_from_config, train_cost

# Dedicated generation GPUs hold no training state: NeMo-RL's own async recipe for Qwen3-32B
# (examples/configs/recipes/llm/performance/grpo-qwen3-32b-8n8g-async-1off.yaml) raises the share from
# its colocated parent's 0.6 to 0.8.
DEDICATED_GPU_MEMORY_UTILIZATION = 0.8
# The async modes compared: NeMo-RL's ages 1 and 2, without and with in-flight weight updates (KV kept,
# NeMo-RL's default). NeMo-RL warns that an age above 1 without in-flight updates gains nothing.
ASYNC_MODES = (AsyncSetting(1), AsyncSetting(2), AsyncSetting(1, True), AsyncSetting(2, True))
# The presets' rule (docs/cluster.md section 8): at least 15% more tokens trained per hour, with the
# trained tokens at most 2 policy versions old on average.
PAYS_TOKENS = 1.15
MAX_MEAN_STALENESS = 2.0
# check's; bench/generation.py averages 40 (a few per cent apart: one step's length is its slowest tail's)
SIMULATED_STEPS = ASYNC_SIMULATED_STEPS


@dataclass(frozen=True)
class Split:
    generation_gpus: int
    config: dict  # the config as an async run on this split sets it
    plan: ClusterPlan

    @property
    def label(self) -> str:
        p = self.plan.parallel
        return f"{self.generation_gpus} gen + {self.plan.train_gpus} train (TP{p.tp} PP{p.pp} CP{p.cp} DP{p.dp})"


@dataclass
class ModeResult:
    mode: str
    split: str
    gpus: int
    step_s: float
    tokens_per_step: float  # response tokens trained per step
    generation_idle_s: float  # per step, per generation GPU
    train_idle_s: float  # per step, the training GPUs
    staleness_mean: float  # policy versions per trained token
    staleness_max: float
    async_stats: AsyncStats | None = None
    setting: AsyncSetting | None = None
    split_config: dict | None = field(default=None, repr=False)

    @property
    def tokens_per_hour(self) -> float:
        return 3600.0 * self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_hour / 3600.0 / self.gpus


def _with(config: dict, values: dict[str, object]) -> dict:
    out = copy.deepcopy(config)
    for dotted, v in values.items():
        node = out
        *parents, last = dotted.split(".")
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[last] = v
    return out


def async_splits(config: dict, nodes: int, gpus_per_node: int, model: ModelShape, gpu: str) -> list[Split]:
    """Every generation/training split an async run of this config can use (module docstring)."""
    vllm = "policy.generation.vllm_cfg"
    engine_gpus = int(value(config, f"{vllm}.tensor_parallel_size")) * int(value(config, f"{vllm}.pipeline_parallel_size"))
    colocated = bool(value(config, "policy.generation.colocated.enabled"))
    utilization = DEDICATED_GPU_MEMORY_UTILIZATION if colocated else float(value(config, f"{vllm}.gpu_memory_utilization"))
    megatron = bool(value(config, "policy.megatron_cfg.enabled"))
    cp_key = "policy.megatron_cfg.context_parallel_size" if megatron else "policy.dtensor_cfg.context_parallel_size"
    if nodes > 1:
        shares = [(k * gpus_per_node, {"num_nodes": k, "gpus_per_node": gpus_per_node}) for k in range(1, nodes)]
    else:
        shares = [(g, {"gpus_per_node": g}) for g in range(1, gpus_per_node)]
    gbs = int(value(config, "policy.train_global_batch_size"))
    splits = []
    for generation_gpus, resources in shares:
        if generation_gpus % engine_gpus:
            continue
        cp = int(value(config, cp_key) or 1)
        while cp >= 1:
            candidate = _with(config, {
                "policy.generation.colocated.enabled": False,
                "policy.generation.colocated.resources": resources,
                f"{vllm}.gpu_memory_utilization": utilization,
                cp_key: cp,
            })
            plan, findings = plan_cluster(candidate, nodes, gpus_per_node)
            runs = plan is not None and not any(f.level == "error" for f in findings) and gbs % plan.parallel.dp == 0
            if runs and estimate(model, plan.parallel, plan.training, plan.generation, gpu).fits:
                splits.append(Split(generation_gpus, candidate, plan))
                break
            cp //= 2
    return splits


def simulate_split(split: Split, model: ModelShape, gpu: str, lengths: LengthModel, prompt_tokens: int,
                   setting: AsyncSetting, steps: int = SIMULATED_STEPS) -> AsyncStats:
    shape = rollout_shape_for(split.config, split.generation_gpus, model, gpu, prompt_tokens)
    if shape.max_model_len > shape.engine.kv_tokens:
        raise GenerationModelError(f"max_model_len {shape.max_model_len} exceeds an engine's KV cache")
    mean, mean_squared = response_moments(shape, lengths)
    cost = train_cost(model, shape_from_config(split.config, split.plan.train_gpus, mean, mean_squared), gpu)
    return simulate_async(shape, lengths, setting, cost, transfer_seconds(model), steps=steps)


def async_result(stats: AsyncStats, split: Split, setting: AsyncSetting, gpus: int) -> ModeResult:
    return ModeResult(
        mode=setting.label, split=split.label, gpus=gpus, step_s=stats.step_s, tokens_per_step=stats.tokens,
        generation_idle_s=stats.generation_idle_s, train_idle_s=stats.train_idle_s,
        staleness_mean=stats.staleness_mean, staleness_max=stats.staleness_max, async_stats=stats,
        setting=setting, split_config=split.config,
    )


def best_async(splits: list[Split], model: ModelShape, gpu: str, lengths: LengthModel, prompt_tokens: int,
               setting: AsyncSetting, gpus: int, steps: int = SIMULATED_STEPS) -> ModeResult | None:
    """The split that trains the most tokens per hour in this mode (None: no split runs it)."""
    best = None
    for split in splits:
        try:
            stats = simulate_split(split, model, gpu, lengths, prompt_tokens, setting, steps)
        except GenerationModelError:
            continue  # max_model_len does not fit this split's engines
        result = async_result(stats, split, setting, gpus)
        if best is None or result.tokens_per_hour > best.tokens_per_hour:
            best = result
    return best


def layout_label(plan: ClusterPlan) -> str:
    if not plan.generation_gpus:
        return f"colocated on {plan.train_gpus} GPUs"
    return Split(plan.generation_gpus, {}, plan).label


def sync_results(step: StepPlan, plan: ClusterPlan) -> list[ModeResult]:
    """Sync without partial rollouts, and with the config's block (else the sweep's best budget), on the
    config's own layout."""
    report, rest = step.report, step.without.logprob_s + step.without.train_s
    gpus = plan.train_gpus + plan.generation_gpus

    def row(label: str, stats) -> ModeResult:
        tail = max(0.0, stats.generation_s - stats.engine_s / report.shape.engines)  # waiting for the slowest
        return ModeResult(
            mode=label, split=layout_label(plan), gpus=gpus, step_s=report.generation_s(stats) + rest,
            tokens_per_step=report.tokens_per_step,
            # colocated, the GPUs take turns; split, each side also waits for the other's phase
            generation_idle_s=tail + (rest if plan.generation_gpus else 0.0),
            train_idle_s=report.generation_s(stats) if plan.generation_gpus else 0.0,
            staleness_mean=stats.staleness_mean, staleness_max=stats.staleness_max,
        )

    out = [row("sync", report.without)]
    if report.configured is not None:
        out.append(row(f"sync + partial rollouts {report.configured_budget} (this config's)", report.configured))
    elif report.best_budget is not None:
        out.append(row(f"sync + partial rollouts {report.best_budget}", report.sweep[report.best_budget]))
    return out


@dataclass
class ModeComparison:
    rows: list[ModeResult]
    shipped: ModeResult  # the config's own mode: the baseline of the rule
    splits: int  # async splits that fit

    def gain(self, row: ModeResult) -> float:
        return row.tokens_per_hour / self.shipped.tokens_per_hour if self.shipped.tokens_per_hour else 0.0

    def pays(self, row: ModeResult) -> bool:
        return self.gain(row) >= PAYS_TOKENS and row.staleness_mean <= MAX_MEAN_STALENESS

    @property
    def best(self) -> ModeResult:
        eligible = [r for r in self.rows if r.staleness_mean <= MAX_MEAN_STALENESS]
        return max(eligible, key=lambda r: r.tokens_per_hour)


def compare_modes(config: dict, plan: ClusterPlan, step: StepPlan, nodes: int, gpus_per_node: int,
                  model: ModelShape, gpu: str, prompt_tokens: int, modes: tuple[AsyncSetting, ...] = ASYNC_MODES,
                  steps: int = SIMULATED_STEPS) -> ModeComparison:
    """The sync rows on the config's own layout, each async mode at its best split, and the config's own
    mode (the rule's baseline)."""
    gpus = nodes * gpus_per_node
    rows = sync_results(step, plan)
    splits = async_splits(config, nodes, gpus_per_node, model, gpu)
    for setting in modes:
        result = best_async(splits, model, gpu, step.lengths, prompt_tokens, setting, gpus, steps)
        if result is not None:
            rows.append(result)
    setting = AsyncSetting.of_config(config)
    if setting is not None and step.own_async is not None:
        shipped = async_result(step.own_async, Split(plan.generation_gpus, config, plan), setting, gpus)
        shipped.mode = f"{setting.label} (this config)"
        # the search may have found the config's own mode on its own split: one row, the config's
        rows = [r for r in rows if not (r.setting == setting and r.split == shipped.split)]
        rows.append(shipped)
    else:
        shipped = rows[1] if step.report.configured is not None else rows[0]
    return ModeComparison(rows, shipped, len(splits))


def async_warnings(comparison: ModeComparison) -> list[Finding]:
    """A warning when a mode this config does not run passes the presets' rule against the one it runs."""
    shipped = comparison.shipped
    # sync against sync with partial rollouts is generation_check.generation_warnings' to say
    candidates = [
        r for r in comparison.rows
        if r is not shipped and comparison.pays(r) and (r.setting is not None or shipped.setting is not None)
    ]
    if not candidates:
        return []
    best = max(candidates, key=lambda r: r.tokens_per_hour)
    message = (
        f"{best.mode} on {best.split} would train {comparison.gain(best):.2f}x the response tokens per hour of "
        f"this config ({best.tokens_per_hour / 1e6:.1f}M against {comparison.shipped.tokens_per_hour / 1e6:.1f}M), "
        f"tokens {best.staleness_mean:.1f} policy versions old on average (docs/cluster.md section 8)"
    )
    return [Finding("warning", "grpo.async_grpo" if best.setting else "partial_rollouts", message)]


def preset_overrides(row: ModeResult) -> dict[str, object]:
    """The keys an async row sets on its config: what a preset of it would hold."""
    if row.setting is None or row.split_config is None:
        return {}
    c = row.split_config
    keys: dict[str, object] = {
        "grpo.async_grpo.enabled": True,
        "grpo.async_grpo.max_trajectory_age_steps": row.setting.max_age,
        "grpo.async_grpo.in_flight_weight_updates": row.setting.in_flight,
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates": row.setting.recompute_kv,
        "policy.generation.vllm_cfg.async_engine": True,
        "policy.generation.colocated.enabled": False,
        "policy.generation.colocated.resources": get(c, "policy.generation.colocated.resources"),
        "policy.generation.vllm_cfg.gpu_memory_utilization": get(c, "policy.generation.vllm_cfg.gpu_memory_utilization"),
    }
    for key in ("policy.megatron_cfg.context_parallel_size", "policy.dtensor_cfg.context_parallel_size"):
        if get(c, key) is not None:
            keys[key] = get(c, key)
    return keys
