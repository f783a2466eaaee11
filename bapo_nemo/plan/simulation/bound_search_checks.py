"""The checks about BAPO's bound search on a cluster plan: how many responses one search sees (and the
warning when too few), and what `granularity: step` costs in compute. They read the kept search
simulation, so they run in `bapo-nemo check` only (plan/registry.py)."""

from __future__ import annotations

from dataclasses import replace

from bapo_nemo.plan.rules.checks import bapo_enabled
from bapo_nemo.plan.rules.cluster_plan import ClusterPlan
from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding, value
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.simulation.search_stats import (
    DEFAULT_PASS_RATE_BETA,
    DEFAULT_PROMPT_TOKENS,
    MIN_RESPONSES_PER_SEARCH,
    LengthModel,
    LengthModelError,
    SearchShape,
    SearchStats,
    too_few,
)
from bapo_nemo.plan.simulation.simulations import length_moments, search_statistics
from bapo_nemo.plan.simulation.step_cost import StepCost, step_granularity_cost


def search_shape(config: dict, plan: ClusterPlan, prompt_tokens: int | None = None) -> SearchShape:
    """The batch shape one BAPO bound search sees under this config and cluster plan."""
    packing = bool(value(config, "policy.sequence_packing.enabled"))
    seq = int(value(config, "policy.max_total_sequence_length"))
    mbs = int(value(config, "policy.train_micro_batch_size"))
    block = get(config, "loss_fn.bapo") or {}
    return SearchShape(
        global_batch=int(value(config, "policy.train_global_batch_size")),
        group_size=int(value(config, "grpo.num_generations_per_prompt")),
        dp=plan.parallel.dp,
        bin_tokens=int(get(config, "policy.sequence_packing.train_mb_tokens", seq * mbs)) if packing else None,
        micro_batch_size=mbs,
        pad_multiple=int(get(config, "policy.sequence_packing.sequence_length_round", 64) or 1) if packing else 1,
        prompt_tokens=DEFAULT_PROMPT_TOKENS if prompt_tokens is None else int(prompt_tokens),
        granularity=str(block.get("granularity", "microbatch")),
    )


def search_statistics_rules(
    config: dict,
    plan: ClusterPlan | None,
    lengths: LengthModel | None = None,
    prompt_tokens: int | None = None,
    pass_rate_beta: tuple[float, float] = DEFAULT_PASS_RATE_BETA,
) -> tuple[SearchStats | None, list[Finding]]:
    """Expected responses and prompt groups per bound search (bapo_nemo.plan.simulation.search_stats), and a
    warning naming loss_fn.bapo.granularity when a search sees too few for its share to mean anything."""
    if plan is None or not bapo_enabled(config):
        return None, []
    shape = search_shape(config, plan, prompt_tokens)
    # vLLM stops a response at max_new_tokens or at the model length (max_model_len), whichever is first.
    seq = int(value(config, "policy.max_total_sequence_length"))
    cap = min(int(get(config, "policy.generation.max_new_tokens", seq)), seq - shape.prompt_tokens)
    lengths = LengthModel(max_tokens=cap) if lengths is None else replace(lengths, max_tokens=cap)
    try:
        stats = search_statistics(shape, lengths, pass_rate_beta)
    except LengthModelError as exc:
        return None, [Finding("error", "policy.sequence_packing.train_mb_tokens", str(exc))]
    if not too_few(stats):
        return stats, []
    fix = (
        "set loss_fn.bapo.granularity=step (one search per optimizer step, docs/nemo_rl.md gives its cost)"
        if shape.granularity != "step"
        else "raise policy.train_global_batch_size"
    )
    return stats, [
        Finding(
            "warning",
            "loss_fn.bapo.granularity",
            f"each bound search sees ~{stats.responses_median:.0f} responses (p10-p90 "
            f"{stats.responses_p10:.0f}-{stats.responses_p90:.0f}) from ~{stats.groups_mean:.1f} prompt "
            f"groups, and {stats.one_sided:.0%} of searches see one advantage sign only (their bounds are "
            f"set by packing, not by the policy); BAPO needs >= {MIN_RESPONSES_PER_SEARCH} responses per "
            f"search: {fix}",
        )
    ]


def step_granularity_cost_for(
    config: dict, plan: ClusterPlan | None, model: ModelShape | None, stats_lengths: LengthModel | None = None,
    prompt_tokens: int | None = None,
) -> StepCost | None:
    """The compute `granularity: step` adds for this config (bapo_nemo.plan.simulation.step_cost)."""
    if plan is None or model is None or not bapo_enabled(config):
        return None
    prompt = DEFAULT_PROMPT_TOKENS if prompt_tokens is None else int(prompt_tokens)
    seq = int(value(config, "policy.max_total_sequence_length"))
    cap = min(int(get(config, "policy.generation.max_new_tokens", seq)), seq - prompt)
    lengths = LengthModel(max_tokens=cap) if stats_lengths is None else replace(stats_lengths, max_tokens=cap)
    mean, mean_sq = length_moments(lengths, prompt)
    rollout = int(value(config, "grpo.num_prompts_per_step")) * int(value(config, "grpo.num_generations_per_prompt"))
    return step_granularity_cost(
        model,
        rollout,
        int(value(config, "policy.train_global_batch_size")),
        plan.training.activation_checkpointing,
        mean,
        mean_sq,
    )
