"""What `bapo-nemo check` prints and writes as JSON about generation: the config's step with and without
partial rollouts (plan/simulation/step_plan.py), an async config's own pipeline (plan/simulation/async_generation.py), and the
modes side by side (plan/simulation/mode_compare.py). Every figure is simulated: a planning model, said on screen."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.simulation.async_generation import REPLAY_BYTES_PER_TOKEN, AsyncStats
from bapo_nemo.plan.simulation.generation_check import PAYS
from bapo_nemo.plan.simulation.mode_compare import MAX_MEAN_STALENESS, PAYS_TOKENS, ModeComparison, ModeResult
from bapo_nemo.plan.simulation.step_plan import StepPlan, driver_state_gb


def seconds_json(est) -> dict:
    return {
        "generation": est.generation_s,
        "logprob_passes": est.logprob_s,
        "training": est.train_s,
        "step": est.step_s,
        "validation": est.validation_s,
        "save": est.save_s,
        "margin": est.margin_s,
        "recommended_signal_lead": est.recommended_lead_s,
        "bapo_step_granularity": est.bapo_s,
        "bapo_share": est.bapo_share,
    }


def _stats_json(report, stats) -> dict:
    return {
        "generated_tokens_per_s": stats.tokens_per_s,
        "speedup": report.speedup(stats),
        "generation_s": report.generation_s(stats),
        "iterations_per_step": stats.iterations,
        "prefill_share": stats.prefill_share,
        "preemptions_per_step": stats.preemptions,
        "staleness_mean": stats.staleness_mean,
        "stale_token_share": stats.stale_token_share,
        "truncated_share": stats.truncated_share,
        "in_flight_responses": stats.in_flight_responses,
        "in_flight_tokens": stats.in_flight_tokens,
    }


def _mode_json(comparison: ModeComparison, row: ModeResult) -> dict:
    out = {
        "mode": row.mode,
        "split": row.split,
        "step_s": row.step_s,
        "response_tokens_per_step": row.tokens_per_step,
        "tokens_trained_per_hour": row.tokens_per_hour,
        "tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
        "vs_this_config": comparison.gain(row),
        "generation_idle_s_per_step": row.generation_idle_s,
        "train_idle_s_per_step": row.train_idle_s,
        "staleness_mean_per_token": row.staleness_mean,
        "staleness_max": row.staleness_max,
        "this_config": row is comparison.shipped,
    }
    if row.async_stats is not None:
        out["async"] = async_json(row.async_stats)
    return out


def async_json(stats: AsyncStats) -> dict:
    return {
        "training_s": stats.train_s,
        "weight_transfer_s": stats.transfer_s,
        "staleness_mean_per_response": stats.response_staleness_mean,
        "mixed_version_response_share": stats.mixed_response_share,
        "stale_token_share": stats.stale_token_share,
        "checkpoint_replay_buffer_groups": stats.buffer_groups,
        "checkpoint_replay_buffer_gb": stats.buffer_tokens * REPLAY_BYTES_PER_TOKEN / 1e9,
        "requeue_lost_groups": stats.in_flight_groups,
        "requeue_lost_tokens": stats.in_flight_tokens,
        "cold_fill_s": stats.fill_s,
    }


def generation_json(step: StepPlan, comparison: ModeComparison | None) -> dict:
    r = step.report
    json_gb, ram_gb = driver_state_gb(step.state_tokens)
    return {
        "engines": r.shape.engines,
        "kv_cache_tokens_per_engine": r.shape.engine.kv_tokens,
        "response_tokens_mean": r.response_tokens,
        "without_partial_rollouts": _stats_json(r, r.without),
        "configured": None if r.configured is None else _stats_json(r, r.configured),
        "budget_sweep": {str(b): _stats_json(r, s) for b, s in r.sweep.items()},
        "best_budget": r.best_budget,
        "prefill_batches": r.prefill_batches,
        "step_time_without_partial_rollouts_s": seconds_json(step.without),
        "step_time_best_budget_s": None if step.best is None else seconds_json(step.best),
        "partial_rollout_state_gb": {"checkpoint_json": json_gb, "driver_memory": ram_gb},
        "async_grpo": None if step.own_async is None else async_json(step.own_async),
        "modes": None if comparison is None else [_mode_json(comparison, row) for row in comparison.rows],
    }


def print_generation(console: Console, step: StepPlan, config: dict, lengths_label: str) -> None:
    r, shape = step.report, step.report.shape
    gpus = shape.engines * shape.engine.gpus
    console.print(
        f"generation model (simulated continuous batching, a planning figure): {shape.engines} vLLM engines of "
        f"{shape.engine.gpus} GPUs, KV cache {shape.engine.kv_tokens:,} tokens each "
        f"({shape.engine.kv_tokens // shape.max_model_len} sequences at max_model_len); responses {lengths_label}: "
        f"mean {r.response_tokens:,.0f} tokens, cap {shape.response_cap:,}"
    )

    def line(label, stats, est) -> str:
        return (
            f"  {label}: {stats.tokens_per_s:,.0f} generated tokens/s ({stats.tokens_per_s / gpus:,.0f}/GPU, "
            f"{r.speedup(stats):.2f}x), generation {est.generation_s:.0f}s, step {est.step_s:.0f}s"
        )

    if step.own_async is not None:
        print_async(console, step.own_async)
    else:
        console.print(line("without partial rollouts", r.without, step.without))
    if r.configured is not None and step.own_async is None:
        c = r.configured
        console.print(
            line(f"with this config's partial rollouts (token_budget {r.configured_budget}, prefill_batches "
                 f"{r.prefill_batches})", c, step.configured)
            + f"; tokens {c.staleness_mean:.1f} policy versions old on average ({c.stale_token_share:.0%} from "
            f"older policies), prefill {c.prefill_share:.0%} of engine time, {c.preemptions:,.0f} preemptions "
            "per step"
        )
        json_gb, ram_gb = driver_state_gb(step.state_tokens)
        console.print(
            f"  partial-rollout state: ~{c.in_flight_responses:,.0f} responses, {step.state_tokens / 1e6:.1f}M "
            f"tokens in flight after a step: partial_rollouts.json ~{json_gb:.2f} GB per checkpoint (in the "
            f"save time), ~{ram_gb:.1f} GB of driver memory"
        )
    if r.sweep:
        _print_sweep(console, step)
    est = step.estimate
    if est.bapo_s > 0:
        console.print(
            f"BAPO's own cost (granularity step's extra log-prob passes, step_bounds_sample "
            f"{(get(config, 'loss_fn.bapo') or {}).get('step_bounds_sample', 1)}): {est.bapo_s:.0f}s = "
            f"{est.bapo_share:.1%} of the step"
            + (f" ({step.without.bapo_share:.1%} without partial rollouts)" if step.configured else "")
        )


def _print_sweep(console: Console, step: StepPlan) -> None:
    """The step at each token_budget of the sweep, and which budget is best."""
    r = step.report
    rest = step.without.logprob_s + step.without.train_s
    cells = ", ".join(
        f"{b}: {s.tokens_per_s:,.0f} tok/s, step {r.generation_s(s) + rest:.0f}s" for b, s in r.sweep.items()
    )
    if r.configured is not None:
        console.print(
            f"  token_budget sweep (prefill_batches {r.prefill_batches}, max_resumptions to the cap): {cells}; "
            f"best {r.best_budget}"
        )
    else:
        shorter = 1 - (r.generation_s(r.sweep[r.best_budget]) + rest) / step.without.step_s
        verdict = (
            f"the best, {r.best_budget}, would make the step {shorter:.0%} shorter" if shorter > 0
            else "none would make the step shorter"
        )
        console.print(
            f"  partial rollouts are off in this config. Turned on (prefill_batches 1, max_resumptions to the "
            f"cap), token_budget {cells}; {verdict} (the presets turn them on from {1 - PAYS:.0%})"
        )


def print_async(console: Console, stats: AsyncStats) -> None:
    """An async GRPO config's own pipeline: the step, both sides' idle time, the age of the tokens, and
    what a checkpoint keeps and a requeue loses."""
    console.print(
        f"  this config's async GRPO on its split: step {stats.step_s:.0f}s (training {stats.train_s:.0f}s, weight "
        f"transfer {stats.transfer_s:.1f}s), {stats.tokens_per_s:,.0f} trained response tokens/s; idle per step: "
        f"generation GPUs {stats.generation_idle_s:.0f}s, training GPUs {stats.train_idle_s:.0f}s; trained tokens "
        f"{stats.staleness_mean:.2f} policy versions old per token (NeMo-RL's per-trajectory record: "
        f"{stats.response_staleness_mean:.2f}; {stats.mixed_response_share:.0%} of the responses mix versions)"
    )
    lost_s = stats.in_flight_tokens / stats.tokens_per_s if stats.tokens_per_s else 0.0
    console.print(
        f"  a checkpoint keeps ~{stats.buffer_groups:,.0f} finished prompt groups (replay_buffer.pt "
        f"~{stats.buffer_tokens * REPLAY_BYTES_PER_TOKEN / 1e9:.2f} GB, in the save time) and loses "
        f"~{stats.in_flight_groups:,.0f} groups in flight ({stats.in_flight_tokens / 1e6:.1f}M generated tokens, "
        f"~{lost_s:.0f}s of generation) on a requeue; a cold start waits {stats.fill_s:.0f}s for its first batch"
    )


def print_modes(console: Console, comparison: ModeComparison) -> None:
    table = Table(
        title="GRPO modes on these GPUs, each at its best split (simulated, a planning figure)",
    )
    table.add_column("mode", overflow="fold")
    table.add_column("GPUs", overflow="fold")
    for name in ("tok/s/GPU", "tok/hour", "vs config", "step", "idle gen|train", "age mean|max"):
        table.add_column(name, justify="right")
    for row in comparison.rows:
        mark = "[bold]" if row is comparison.shipped else ""
        table.add_row(
            f"{mark}{row.mode}", row.split, f"{row.tokens_per_s_per_gpu:,.0f}", f"{row.tokens_per_hour / 1e6:.1f}M",
            f"{comparison.gain(row):.2f}x", f"{row.step_s:.0f}s",
            f"{row.generation_idle_s:.0f}s|{row.train_idle_s:.0f}s",
            f"{row.staleness_mean:.2f}|{row.staleness_max:.0f}",
        )
    console.print(table)
    if not comparison.splits:
        console.print("  async GRPO: no split of these GPUs holds a training replica that fits (memory model)")
    console.print(
        f"  tok: response tokens trained; idle: seconds per step each side waits (gen: per GPU); age: "
        f"policy versions per trained token. The presets change mode at >= {PAYS_TOKENS:.2f}x the tokens trained "
        f"per hour with a mean age <= {MAX_MEAN_STALENESS:g} (docs/cluster.md section 8)"
    )
