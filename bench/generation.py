"""Simulated generation of the shipped cluster configs, with and without partial rollouts (the model of
`bapo-nemo check`: bapo_nemo/plan/generation.py; planning figures from byte and FLOP counts, not
measurements).

For each config on its shipped shape (bapo_7b on 1 x 8 H100, bapo_32b and bapo_32b_64k on 8 x 8), with
the default long chain-of-thought response lengths (log-normal, median 9,000 tokens, sigma 0.8):
without partial rollouts, then with them at budgets cap/8, cap/4, cap/2 and pools of 1 and 2 extra
batches (max_resumptions up to the response cap, stale_segments keep). Per row: generated tokens/s
(and against no partial rollouts, simulated side by side on the same engines), the step (generation +
log-prob passes + training), BAPO's share of it (granularity step's extra passes), the staleness of
the handed-out tokens. One more row: bapo_32b at its best budget with the rows of each segment call in
schedule order, as the hook sent them before it dealt them across the engines.

Plot: engine occupancy (running requests and KV cache) of the slowest engine over one GRPO step of
bapo_32b_64k, without and with its preset's partial rollouts.

    python bench/generation.py [--steps 8]     (~5 min on the shared 2-core machine)
Writes bench/results/generation.json and docs/results/generation_occupancy.png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bapo_nemo.plan.cluster_plan import plan_cluster
from bapo_nemo.plan.config_io import get, load_nemo_config
from bapo_nemo.plan.generation import response_moments, simulate_partial, simulate_without_partial
from bapo_nemo.plan.generation_check import budget_grid, covering, partial_setting, rollout_shape_for
from bapo_nemo.plan.models import BUILTIN
from bapo_nemo.plan.search_stats import DEFAULT_PROMPT_TOKENS, LengthModel
from bapo_nemo.plan.step_time import estimate_step_time, shape_from_config
from bapo_nemo.rollout import PartialRolloutConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOT = ROOT / "docs" / "results" / "generation_occupancy.png"
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
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows, occupancy = [], {}
    for name, nodes in CONFIGS:
        config_table, traces = config_rows(name, nodes, args.steps)
        rows += config_table
        if name == "bapo_32b_64k":
            occupancy = traces
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "generation.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "seconds": time.perf_counter() - t0}, indent=1))
    plot(occupancy, PLOT)
    header = (f"{'config':13s} {'partial rollouts':29s} {'budget':>6s} {'pool':>4s} {'tok/s':>8s} {'/GPU':>6s} "
              f"{'x':>5s} {'gen s':>6s} {'step s':>6s} {'BAPO':>5s} {'stale':>5s} {'prefill':>7s}")
    print(header)
    for r in rows:
        print(
            f"{r['config']:13s} {r['partial_rollouts']:29s} {r['token_budget'] or '':>6} {r['prefill_batches'] or '':>4} "
            f"{r['tokens_per_s']:8,.0f} {r['tokens_per_s_per_gpu']:6,.0f} {r['speedup']:5.2f} {r['generation_s']:6.0f} "
            f"{r['step_s']:6.0f} {r['bapo_share']:5.1%} {r['staleness_mean']:5.2f} {r['prefill_share']:7.1%}"
        )
    print(f"{time.perf_counter() - t0:.0f} s; wrote {out} and {PLOT} (simulated: a planning model, not a measurement)")


if __name__ == "__main__":
    main()
