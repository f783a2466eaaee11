"""Simulated generation of the shipped cluster configs, with and without partial rollouts, and the GRPO
modes side by side: sync, sync with partial rollouts, async GRPO (the model of `bapo-nemo check`:
bapo_nemo/plan/simulation/generation.py, plan/simulation/async_generation.py, plan/simulation/mode_compare.py; planning figures from byte
and FLOP counts, not measurements).

For each config on its shipped shape (bapo_7b on 1 x 8 H100, bapo_32b and bapo_32b_64k on 8 x 8), with
the default long chain-of-thought response lengths (log-normal, median 9,000 tokens, sigma 0.8):
without partial rollouts, then with them at budgets cap/8, cap/4, cap/2 and pools of 1 and 2 extra
batches (max_resumptions up to the response cap, stale_segments keep). Per row: generated tokens/s
(and against no partial rollouts, simulated side by side on the same engines), the step (generation +
log-prob passes + training), BAPO's share of it (granularity step's extra passes), the staleness of
the handed-out tokens. One more row: bapo_32b at its best budget with the rows of each segment call in
schedule order, as the hook sent them before it dealt them across the engines.

Then per config, the modes on the same GPUs, each async mode at its best split of them (plan/simulation/mode_compare.py):
sync, sync with partial rollouts (the preset's block, else the best budget), async GRPO at ages 1 and 2
without and with in-flight weight updates, and in-flight updates with the KV cache recomputed. Per row:
response tokens trained per hour and per second per GPU (and against the preset's own mode), the step,
idle seconds per step on each side, the age of the trained tokens (policy versions per token), and for
async what a checkpoint keeps and a requeue loses; then the keys an async preset of the best async row
would set.

Plots: engine occupancy (running requests and KV cache) of the slowest engine over one GRPO step of
bapo_32b_64k, without and with its preset's partial rollouts; trained tokens/s per GPU against the age of
the trained tokens for every mode of every config, with the presets' bar.

    python bench/generation.py [--steps 8] [--mode-steps 40]     (~5 min on the shared 2-core machine)
Writes bench/results/generation.json, docs/results/generation_occupancy.png and
docs/results/generation_modes.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bapo_nemo.plan.rules.cluster_plan import plan_cluster
from bapo_nemo.plan.rules.config_io import get, load_nemo_config
from bapo_nemo.plan.rules.models import BUILTIN
from bapo_nemo.plan.simulation.async_generation import REPLAY_BYTES_PER_TOKEN, AsyncSetting
from bapo_nemo.plan.simulation.generation import response_moments, simulate_partial, simulate_without_partial
from bapo_nemo.plan.simulation.generation_check import (
    budget_grid,
    covering,
    partial_setting,
    rollout_shape_for,
)
from bapo_nemo.plan.simulation.mode_compare import (
    ASYNC_MODES,
    MAX_MEAN_STALENESS,
    PAYS_TOKENS,
    ModeComparison,
    compare_modes,
    preset_overrides,
)
from bapo_nemo.plan.simulation.search_stats import DEFAULT_PROMPT_TOKENS, LengthModel
from bapo_nemo.plan.simulation.step_plan import plan_step
from bapo_nemo.plan.simulation.step_time import estimate_step_time, shape_from_config
from bapo_nemo.rollout import PartialRolloutConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOT = ROOT / "docs" / "results" / "generation_occupancy.png"
MODES_PLOT = ROOT / "docs" / "results" / "generation_modes.png"
# the bench's extra mode: in-flight updates that recompute the KV cache (NeMo-RL's AReaL-style option)
BENCH_MODES = (*ASYNC_MODES, AsyncSetting(1, True, True))
CONFIGS = (("bapo_7b", 1), ("bapo_32b", 8), ("bapo_32b_64k", 8))
POOLS = (1, 2)


def config_rows(name: str, nodes: int, steps: int) -> tuple[list[dict], dict]:
    config = load_nemo_config(ROOT / "configs" / f"{name}.yaml")
    plan, _ = plan_cluster(config, nodes, 8)
    model = BUILTIN[get(config, "policy.model_name")]
    shape = rollout_shape_for(config, plan.generation_gpus or plan.train_gpus, model, "h100-80gb", DEFAULT_PROMPT_TOKENS)
    lengths = LengthModel(shape.response_cap)
    mean, mean_squared = response_moments(shape, lengths)
    step_shape = shape_from_config(config, plan.train_gpus, mean, mean_squared)
    tokens = (mean - shape.prompt_tokens) * shape.prompts_per_step * shape.group_size

    def row(label: str, stats, budget=None, pool=None) -> dict:
        est = estimate_step_time(model, step_shape, "h100-80gb", nodes, tokens / stats.tokens_per_s, 0.0)
        return {
            "config": name, "partial_rollouts": label, "token_budget": budget, "prefill_batches": pool,
            "tokens_per_s": stats.tokens_per_s, "tokens_per_s_per_gpu": stats.tokens_per_s / (nodes * 8),
            "generation_s": est.generation_s, "step_s": est.step_s, "bapo_share": est.bapo_share,
            "staleness_mean": stats.staleness_mean, "stale_token_share": stats.stale_token_share,
            "prefill_share": stats.prefill_share, "preemptions": stats.preemptions,
        }

    without = simulate_without_partial(shape, lengths, steps=steps, trace_step=0)
    rows = [row("without", without)]
    shipped = partial_setting(config)
    base = shipped[0] if shipped else PartialRolloutConfig(token_budget=shape.response_cap, stale_segments="keep")
    traces = {"without": without.occupancy}
    for pool in POOLS:
        for budget in budget_grid(shape.response_cap):
            stats = simulate_partial(shape, lengths, covering(base, budget, shape.response_cap), pool, steps=steps,
                                     trace_step=0)
            rows.append(row("with", stats, budget, pool))
            if shipped and (budget, pool) == (shipped[0].token_budget, shipped[1]):
                rows[-1]["partial_rollouts"] = "with (shipped)"
                traces["with"] = stats.occupancy
    if name == "bapo_32b":
        best = min((r for r in rows if r["token_budget"]), key=lambda r: r["step_s"])
        stats = simulate_partial(
            shape, lengths, covering(base, best["token_budget"], shape.response_cap), best["prefill_batches"],
            steps=steps, balance=False,
        )
        rows.append(row("with, rows in schedule order", stats, best["token_budget"], best["prefill_batches"]))
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows, traces


def mode_rows(name: str, nodes: int, sync_steps: int, async_steps: int) -> tuple[list[dict], ModeComparison]:
    """The modes of one config side by side (plan/simulation/mode_compare.py), averaged over more steps than check."""
    config = load_nemo_config(ROOT / "configs" / f"{name}.yaml")
    plan, _ = plan_cluster(config, nodes, 8)
    model = BUILTIN[get(config, "policy.model_name")]
    step, _ = plan_step(config, plan, model, "h100-80gb", nodes, LengthModel(1), DEFAULT_PROMPT_TOKENS,
                        steps=sync_steps, async_steps=async_steps)
    comparison = compare_modes(config, plan, step, nodes, 8, model, "h100-80gb", DEFAULT_PROMPT_TOKENS,
                               modes=BENCH_MODES, steps=async_steps)
    rows = []
    for r in comparison.rows:
        row = {
            "config": name, "mode": r.mode, "split": r.split, "this_config": r is comparison.shipped,
            "tokens_per_hour": r.tokens_per_hour, "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
            "vs_this_config": comparison.gain(r), "step_s": r.step_s, "generation_idle_s": r.generation_idle_s,
            "train_idle_s": r.train_idle_s, "staleness_mean": r.staleness_mean, "staleness_max": r.staleness_max,
            "pays": comparison.pays(r) and r is not comparison.shipped, "async": r.setting is not None,
        }
        a = r.async_stats
        if a is not None:
            row.update({
                "response_staleness_mean": a.response_staleness_mean, "mixed_response_share": a.mixed_response_share,
                "checkpoint_groups": a.buffer_groups, "checkpoint_gb": a.buffer_tokens * REPLAY_BYTES_PER_TOKEN / 1e9,
                "requeue_lost_groups": a.in_flight_groups, "requeue_lost_tokens": a.in_flight_tokens,
                "requeue_lost_s": a.in_flight_tokens / a.tokens_per_s if a.tokens_per_s else 0.0,
                "cold_fill_s": a.fill_s, "train_s": a.train_s, "transfer_s": a.transfer_s,
                "preset_overrides": preset_overrides(r),
            })
        rows.append(row)
    return rows, comparison


MODE_STYLES = (  # (what the mode label contains, marker, colour, legend)
    ("recomputed", "v", "C4", "async + in-flight, KV recomputed, age 1"),
    ("in-flight, age 2", "^", "C3", "async + in-flight, age 2"),
    ("in-flight, age 1", "^", "C1", "async + in-flight, age 1"),
    ("async, age 2", "o", "C2", "async, age 2"),
    ("async, age 1", "o", "C9", "async, age 1"),
    ("partial", "D", "C5", "sync + partial rollouts"),
    ("sync", "s", "C0", "sync"),
)


def plot_modes(rows: list[dict], path: Path) -> None:
    """Trained tokens/s per GPU against the age of the trained tokens, one panel per config; the presets'
    bar (1.15x the preset's own mode, at most 2 versions on average) shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(5.4 * len(configs), 5.4), squeeze=False)
    for ax, name in zip(axes[0], configs):
        mine = [r for r in rows if r["config"] == name]
        shipped = next(r for r in mine if r["this_config"])
        bar = PAYS_TOKENS * shipped["tokens_per_s_per_gpu"]
        low = min(r["tokens_per_s_per_gpu"] for r in mine) * 0.9
        top = max(max(r["tokens_per_s_per_gpu"] for r in mine), bar) * 1.08
        ax.fill_between([-0.15, MAX_MEAN_STALENESS], bar, top, color="C2", alpha=0.1, lw=0)
        ax.axhline(bar, color="grey", ls=":", lw=1)
        ax.text(-0.1, bar, f"{PAYS_TOKENS:.2f}x the preset's mode", va="bottom", fontsize=7, color="grey")
        placed: list[tuple[float, float]] = []
        for r in sorted(mine, key=lambda r: -r["tokens_per_s_per_gpu"]):
            _, marker, color, _ = next(st for st in MODE_STYLES if st[0] in r["mode"])
            x, y = r["staleness_mean"], r["tokens_per_s_per_gpu"]
            ax.scatter(x, y, marker=marker, color=color, s=70, zorder=3,
                       edgecolor="black" if r["this_config"] else "none", linewidth=1.5)
            gen_train = r["split"].split(" (")[0].replace(" gen + ", "+").replace(" train", " GPUs")
            label = f"{r['vs_this_config']:.2f}x" + (f", {gen_train}" if r["async"] else "")
            # a label that would cover another label or another point goes one line lower, then the next
            line = 0.035 * (top - low)
            points = [(o["staleness_mean"], o["tokens_per_s_per_gpu"]) for o in mine if o is not r]
            ly = y
            while any(abs(x - px) < 0.5 and abs(ly - py) < line for px, py in placed) or any(
                x < px < x + 0.65 and abs(ly - py) < line for px, py in points
            ):
                ly -= line
            placed.append((x, ly))
            ax.annotate(label, (x, y), xytext=(x + 0.07, ly), fontsize=7, va="center",
                        arrowprops={"arrowstyle": "-", "lw": 0.4, "color": "grey"} if ly != y else None)
        ax.set_xlim(-0.15, 2.7)
        ax.set_ylim(low, top)
        ax.set_title(f"{name} (outlined: the preset's mode)", fontsize=10)
        ax.set_xlabel("age of the trained tokens (policy versions per token, mean)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("response tokens trained per second per GPU (all GPUs of the job)")
    handles = [plt.Line2D([], [], marker=m, color=c, ls="", markersize=8, label=text) for _, m, c, text in reversed(MODE_STYLES)]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle("GRPO modes on the presets' GPUs, async at its best split of generation+training GPUs (simulated, "
                 "a planning model). Shaded: the presets' bar, >= 1.15x the tokens per hour at <= 2 versions", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def print_modes(rows: list[dict]) -> None:
    print(f"\n{'config':13s} {'mode':40s} {'split':36s} {'tok/h':>7s} {'/GPU/s':>6s} {'x':>5s} {'step':>5s} "
          f"{'idle g|t':>9s} {'age':>4s} {'max':>3s}")
    for r in rows:
        print(
            f"{r['config']:13s} {r['mode']:40s} {r['split']:36s} {r['tokens_per_hour'] / 1e6:6.1f}M "
            f"{r['tokens_per_s_per_gpu']:6.0f} {r['vs_this_config']:5.2f} {r['step_s']:5.0f} "
            f"{r['generation_idle_s']:4.0f}|{r['train_idle_s']:<4.0f} {r['staleness_mean']:4.2f} {r['staleness_max']:3.0f}"
            + ("  PAYS" if r["pays"] else "")
        )
    for name in dict.fromkeys(r["config"] for r in rows):
        best = max((r for r in rows if r["config"] == name and r["async"] and r["staleness_mean"] <= MAX_MEAN_STALENESS),
                   key=lambda r: r["tokens_per_hour"], default=None)
        if best is None:
            continue
        print(f"{name}: best async row {best['mode']} on {best['split']}: {best['vs_this_config']:.2f}x the preset; "
              f"a checkpoint keeps {best['checkpoint_groups']:.0f} groups ({best['checkpoint_gb']:.2f} GB), a requeue "
              f"loses {best['requeue_lost_groups']:.0f} groups ({best['requeue_lost_tokens'] / 1e6:.1f}M tokens, "
              f"{best['requeue_lost_s']:.0f} s of generation) and waits {best['cold_fill_s']:.0f} s for a cold "
              f"first batch; its keys: {json.dumps(best['preset_overrides'])}")


def plot(traces: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for label, color in (("without", "C0"), ("with", "C1")):
        rows = [r for r in traces.get(label, []) if r[4] == "decode"]
        if not rows:
            continue
        xs = [x for a, b, *_ in rows for x in (a, b)]
        live = [n for _, _, n, *_ in rows for _ in (0, 1)]
        kv = [k / 1e3 for _, _, _, k, _ in rows for _ in (0, 1)]
        name = "without partial rollouts" if label == "without" else "with the preset's partial rollouts"
        end = rows[-1][1]
        axes[0].plot(xs, live, color=color, lw=1, label=f"{name} (step ends at {end:.0f} s)")
        axes[1].plot(xs, kv, color=color, lw=1, label=name)
        for ax in axes:
            ax.axvline(end, color=color, ls=":", lw=1)
    axes[0].set_ylabel("running requests")
    axes[1].set_ylabel("KV cache held (k tokens)")
    axes[1].set_xlabel("seconds into the step's generation (slowest of 16 engines)")
    axes[0].set_title("bapo_32b_64k, 8 x 8 H100: one engine over one GRPO step (simulated)", fontsize=11)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steady-state steps averaged per row")
    parser.add_argument("--mode-steps", type=int, default=40,
                        help="steps averaged per async mode and split (a step's length is its slowest tail's)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows, occupancy, modes = [], {}, []
    for name, nodes in CONFIGS:
        config_table, traces = config_rows(name, nodes, args.steps)
        rows += config_table
        if name == "bapo_32b_64k":
            occupancy = traces
        modes += mode_rows(name, nodes, 2 * args.steps, args.mode_steps)[0]
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "generation.json"
    out.write_text(json.dumps(
        {"args": vars(args), "rows": rows, "modes": modes, "seconds": time.perf_counter() - t0}, indent=1
    ))
    plot(occupancy, PLOT)
    plot_modes(modes, MODES_PLOT)
    header = (f"{'config':13s} {'partial rollouts':29s} {'budget':>6s} {'pool':>4s} {'tok/s':>8s} {'/GPU':>6s} "
              f"{'x':>5s} {'gen s':>6s} {'step s':>6s} {'BAPO':>5s} {'stale':>5s} {'prefill':>7s}")
    print(header)
    for r in rows:
        print(
            f"{r['config']:13s} {r['partial_rollouts']:29s} {r['token_budget'] or '':>6} {r['prefill_batches'] or '':>4} "
            f"{r['tokens_per_s']:8,.0f} {r['tokens_per_s_per_gpu']:6,.0f} {r['speedup']:5.2f} {r['generation_s']:6.0f} "
            f"{r['step_s']:6.0f} {r['bapo_share']:5.1%} {r['staleness_mean']:5.2f} {r['prefill_share']:7.1%}"
        )
    print_modes(modes)
    print(f"{time.perf_counter() - t0:.0f} s; wrote {out}, {PLOT} and {MODES_PLOT} (simulated: a planning model, "
          "not a measurement)")


if __name__ == "__main__":
    main()
