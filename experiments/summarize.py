"""Tables and plots of finished studies, read from their MLflow stores:
`python -m experiments.summarize STUDY [STUDY ...|all] [--quick]`.

For each study: which runs completed (and which did not), per-run statistics, their mean +- std over
seeds per cell, a figure of the curves (mean line, +-1 std band over seeds), and a generated section of
docs/results.md (between `<!-- BEGIN generated MODE/STUDY -->` and `<!-- END ... -->`; the prose around
it is kept). Files: docs/results/<mode>/<study>.png and docs/results/<mode>/<study>.json.

Per-run statistics (W = the last 20% of RL steps, at least one step):
  heldout_start / heldout_end   eval/avg_at_k at step 0 (after warm-up) and at the last step
  heldout_gain                  heldout_end - heldout_start (paired: one warm-up per seed)
  reward_end                    mean of reward/mean over W
  entropy_start / entropy_end   mean token entropy over the first / last W steps
  collapsed                     1 if heldout_end < COLLAPSE_HELDOUT_RATIO * heldout_start (reward
                                collapse) or entropy_end < COLLAPSE_ENTROPY_RATIO * entropy_start
  c_low, c_high, rho, target_met, grad_norm   means over all RL steps
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from experiments.grid import STUDIES, Budget, RunSpec, Study, expand, get_study
from experiments.run import DEFAULT_ROOT, DONE, experiment_name, run_dir, tracking_uri

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

CURVES = ["eval/avg_at_k", "reward/mean", "entropy", "bapo/rho", "bapo/c_low", "bapo/c_high", "grad_norm"]
# The regime's signature (round 2): the share at the run's bounds from the summed masses (for fixed clip:
# the share the paper says falls), and the lengths of right vs wrong responses.
SIGNATURE_KEYS = [
    "bapo/positive_mass",
    "bapo/negative_mass",
    "train/response_length_correct",
    "train/response_length_wrong",
    "rollout/truncated_fraction",
]
HISTORY_KEYS = CURVES + ["bapo/target_met", "eval/pass_at_k", "train/response_length_mean"] + SIGNATURE_KEYS
FINAL_FRACTION = 0.2
COLLAPSE_HELDOUT_RATIO = 0.5
COLLAPSE_ENTROPY_RATIO = 0.25
STAT_KEYS = [
    "heldout_start",
    "heldout_end",
    "heldout_gain",
    "reward_end",
    "entropy_start",
    "entropy_end",
    "collapsed",
    "c_low",
    "c_high",
    "rho",
    "target_met",
    "grad_norm",
    "share",
    "length_wrong_over_correct",
]

History = dict[str, dict[int, float]]  # metric -> step -> value


# ---- arithmetic ----------------------------------------------------------------------------------------------
def window_size(max_steps: int) -> int:
    return max(1, round(FINAL_FRACTION * max_steps))


def _mean_over(series: dict[int, float], steps) -> float:
    values = [series[s] for s in steps if s in series]
    return sum(values) / len(values) if values else math.nan


def run_stats(history: History, max_steps: int) -> dict[str, float]:
    """The per-run statistics of the module docstring, from metric histories (RL steps are 1..max_steps)."""
    w = window_size(max_steps)
    first, last = range(1, w + 1), range(max_steps - w + 1, max_steps + 1)
    rl_steps = range(1, max_steps + 1)
    held = history.get("eval/avg_at_k", {})
    heldout_start = held.get(0, math.nan)
    heldout_end = held[max(held)] if held else math.nan
    entropy = history.get("entropy", {})
    stats = {
        "heldout_start": heldout_start,
        "heldout_end": heldout_end,
        # Paired per seed: every cell of a seed starts from the same warm-up, so the gain removes most of
        # the seed-to-seed spread of the starting point.
        "heldout_gain": heldout_end - heldout_start,
        "reward_end": _mean_over(history.get("reward/mean", {}), last),
        "entropy_start": _mean_over(entropy, first),
        "entropy_end": _mean_over(entropy, last),
    }
    reward_collapse = heldout_end < COLLAPSE_HELDOUT_RATIO * heldout_start
    entropy_collapse = stats["entropy_end"] < COLLAPSE_ENTROPY_RATIO * stats["entropy_start"]
    stats["collapsed"] = 1.0 if (reward_collapse or entropy_collapse) else 0.0
    for key, metric in (
        ("c_low", "bapo/c_low"),
        ("c_high", "bapo/c_high"),
        ("rho", "bapo/rho"),
        ("target_met", "bapo/target_met"),
        ("grad_norm", "grad_norm"),
    ):
        stats[key] = _mean_over(history.get(metric, {}), rl_steps)
    # signature: the positive share of the summed masses at the run's bounds, and how much longer wrong
    # responses are than right ones, over all RL steps
    pos, neg = history.get("bapo/positive_mass", {}), history.get("bapo/negative_mass", {})
    p_sum, n_sum = sum(pos.get(s, 0.0) for s in rl_steps), sum(neg.get(s, 0.0) for s in rl_steps)
    stats["share"] = p_sum / (p_sum + n_sum) if p_sum + n_sum > 0 else math.nan
    wrong = _mean_over(history.get("train/response_length_wrong", {}), rl_steps)
    right = _mean_over(history.get("train/response_length_correct", {}), rl_steps)
    stats["length_wrong_over_correct"] = wrong / right if right and math.isfinite(right) else math.nan
    return stats


def mean_std(values: list[float]) -> tuple[float, float, int]:
    """Mean, sample standard deviation (n-1; nan for n < 2) and n, over the finite values."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, 0
    mean = sum(finite) / len(finite)
    std = statistics.stdev(finite) if len(finite) > 1 else math.nan
    return mean, std, len(finite)


def aggregate(per_run: list[dict[str, float]]) -> dict[str, tuple[float, float, int]]:
    return {key: mean_std([r[key] for r in per_run]) for key in STAT_KEYS}


def fmt(mean: float, std: float, digits: int = 3, signed: bool = False) -> str:
    if not math.isfinite(mean):
        return "—"
    sign = "+" if signed else ""
    if not math.isfinite(std):
        return f"{mean:{sign}.{digits}f}"
    return f"{mean:{sign}.{digits}f} ± {std:.{digits}f}"


# Two-sided 95% quantiles of Student's t for df = 1..30 (beyond: the normal 1.96 is within 2%).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_interval(values: list[float]) -> tuple[float, float, float, int]:
    """Mean and two-sided 95% Student-t interval of the mean (nan bounds for n < 2), and n."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = sum(finite) / n
    if n < 2:
        return mean, math.nan, math.nan, n
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * statistics.stdev(finite) / math.sqrt(n)
    return mean, mean - half, mean + half, n


# ---- reading MLflow ------------------------------------------------------------------------------------------
@dataclass
class RunRecord:
    spec: RunSpec
    completed: bool
    reason: str = ""
    history: History = field(default_factory=dict)
    seconds: float | None = None
    start_ms: int | None = None
    end_ms: int | None = None
    commit: str | None = None  # the repository commit the run's code came from (MLflow tag git.commit)


def load_runs(specs: list[RunSpec], uri: str, experiment: str, root: Path | None = None) -> list[RunRecord]:
    """One record per spec. Completed = an MLflow run of that name is FINISHED and logged the last step."""
    from mlflow.tracking import MlflowClient

    db = Path(uri.removeprefix("sqlite:///"))
    if uri.startswith("sqlite:///") and not db.is_file():
        return [RunRecord(s, False, f"no MLflow store {db}") for s in specs]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    by_name: dict[str, list] = {}
    if exp is not None:
        for run in client.search_runs([exp.experiment_id], max_results=50000):
            by_name.setdefault(run.info.run_name, []).append(run)
    records = []
    for spec in specs:
        candidates = sorted(
            by_name.get(spec.run_name, []), key=lambda r: (r.info.status == "FINISHED", r.info.start_time)
        )
        if not candidates:
            records.append(RunRecord(spec, False, "not started"))
            continue
        run = candidates[-1]
        history: History = {}
        for key in HISTORY_KEYS:
            points = client.get_metric_history(run.info.run_id, key)
            history[key] = {int(m.step): float(m.value) for m in points}
        max_steps = int(spec.overrides["grpo.max_num_steps"])
        last_step = max((max(h) for h in history.values() if h), default=-1)
        completed = run.info.status == "FINISHED" and last_step >= max_steps
        reason = (
            "" if completed else f"{run.info.status.lower()}, last logged step {last_step} of {max_steps}"
        )
        seconds = None
        if root is not None and (run_dir(root, spec) / DONE).is_file():
            seconds = json.loads((run_dir(root, spec) / DONE).read_text()).get("seconds")
        tags = run.data.tags
        commit = tags.get("git.commit", "")[:10] + ("+dirty" if tags.get("git.dirty") == "true" else "")
        records.append(
            RunRecord(
                spec,
                completed,
                reason,
                history,
                seconds,
                run.info.start_time,
                run.info.end_time,
                commit or None,
            )
        )
    return records


# ---- one study ------------------------------------------------------------------------------------------------
@dataclass
class StudySummary:
    study: Study
    mode: str
    budget: Budget
    records: list[RunRecord]
    cells: dict[str, dict[str, tuple[float, float, int]]]  # cell name -> stat -> (mean, std, n)
    per_run: dict[str, dict[str, float]]  # run name -> stats

    @property
    def completed(self) -> list[RunRecord]:
        return [r for r in self.records if r.completed]

    @property
    def missing(self) -> list[RunRecord]:
        return [r for r in self.records if not r.completed]

    @cached_property
    def paired(self) -> list[PairedDifference]:
        """Paired differences against the study's baseline method (computed once for table, plot, JSON)."""
        return paired_differences(self)


def summarize_study(
    study: Study | str,
    mode: str = "full",
    root: Path = DEFAULT_ROOT,
    budget: Budget | None = None,
    uri: str | None = None,
) -> StudySummary:
    study = get_study(study) if isinstance(study, str) else study
    budget = budget or study.budget(mode)
    specs = expand(study, mode, budget)
    by_store: dict[str, list[RunSpec]] = {}
    for spec in specs:  # cells reused from another study are read from that study's store
        by_store.setdefault(spec.study, []).append(spec)
    loaded = {}
    for store, store_specs in by_store.items():
        for record in load_runs(
            store_specs,
            uri or tracking_uri(Path(root), mode, store),
            experiment_name(store, mode),
            Path(root),
        ):
            loaded[(record.spec.study, record.spec.run_name)] = record
    records = [loaded[(s.study, s.run_name)] for s in specs]
    per_run = {r.spec.run_name: run_stats(r.history, budget.max_steps) for r in records if r.completed}
    cells = {}
    for cell in study.cells_for(mode):
        runs = [
            per_run[r.spec.run_name] for r in records if r.completed and r.spec.display_cell.name == cell.name
        ]
        cells[cell.name] = aggregate(runs)
    return StudySummary(study, mode, budget, records, cells, per_run)


# ---- paired comparison ----------------------------------------------------------------------------------------
PAIRED_KEYS = [
    ("heldout_gain", "held-out gain"),
    ("entropy_end", "final entropy"),
    ("reward_end", "final reward"),
]


@dataclass
class PairedDifference:
    cell: str  # the compared cell
    baseline: str  # the baseline cell of the same setting
    key: str
    mean: float
    low: float  # 95% t interval of the mean difference
    high: float
    n: int  # seeds where both completed


def paired_differences(summary: StudySummary) -> list[PairedDifference]:
    """Each cell minus its baseline cell (same labels, method = `study.paired_against`), seed by seed:
    both start from the seed's warm-up, so the difference removes the warm-up's spread."""
    baseline_method = summary.study.paired_against
    if baseline_method is None:
        return []
    by_cell_seed = {
        (r.spec.display_cell.name, r.spec.seed): summary.per_run[r.spec.run_name] for r in summary.completed
    }
    cells = summary.study.cells_for(summary.mode)
    out = []
    for cell in cells:
        if cell.labels.get("method") == baseline_method:
            continue
        base = next(
            (
                c
                for c in cells
                if c.labels.get("method") == baseline_method
                and all(v == cell.labels[k] for k, v in c.labels.items() if k != "method")
            ),
            None,
        )
        if base is None:
            continue
        for key, _ in PAIRED_KEYS:
            diffs = [
                by_cell_seed[(cell.name, seed)][key] - by_cell_seed[(base.name, seed)][key]
                for seed in summary.budget.seeds
                if (cell.name, seed) in by_cell_seed and (base.name, seed) in by_cell_seed
            ]
            out.append(PairedDifference(cell.name, base.name, key, *t_interval(diffs)))
    return out


# ---- figures -------------------------------------------------------------------------------------------------
PANELS = [
    ("eval/avg_at_k", "held-out avg@k"),
    ("reward/mean", "train reward (5-step mean)"),
    ("entropy", "token entropy"),
    ("bapo/rho", "positive share rho"),
    ("bounds", "c_low (dashed) / c_high"),
    ("grad_norm", "grad norm"),
]


def _band(records: list[RunRecord], key: str, smooth: int = 1):
    """Steps present in every run, mean and std over runs (optionally a trailing moving average first)."""
    return _band_of([_derived(r.history, key) for r in records], smooth)


def _derived(history: History, key: str) -> dict[int, float]:
    """A logged metric, or `share` = P / (P + N) of the step's masses at the run's bounds."""
    if key != "share":
        return history.get(key, {})
    pos, neg = history.get("bapo/positive_mass", {}), history.get("bapo/negative_mass", {})
    return {s: pos[s] / (pos[s] + neg[s]) for s in pos if s in neg and pos[s] + neg[s] > 0}


def _band_of(histories: list[dict[int, float]], smooth: int = 1):
    import numpy as np

    series = []
    for h in histories:
        if smooth > 1 and h:
            steps = sorted(h)
            vals = [h[s] for s in steps]
            h = {
                s: sum(vals[max(0, i - smooth + 1) : i + 1]) / len(vals[max(0, i - smooth + 1) : i + 1])
                for i, s in enumerate(steps)
            }
        series.append(h)
    if not series:
        return None
    steps = sorted(set.intersection(*(set(h) for h in series)))
    if not steps:
        return None
    values = np.array([[h[s] for s in steps] for h in series])
    std = values.std(axis=0, ddof=1) if len(series) > 1 else np.zeros(len(steps))
    return np.array(steps), values.mean(axis=0), std


def plot_study(summary: StudySummary, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = summary.study
    cells = study.cells_for(summary.mode)
    row_values = list(dict.fromkeys(c.labels[study.row_axis] for c in cells)) if study.row_axis else [None]
    fig, axes = plt.subplots(
        len(row_values), len(PANELS), figsize=(3.3 * len(PANELS), 2.6 * len(row_values)), squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    line_labels = list(dict.fromkeys(_line_label(c.labels, study.row_axis) for c in cells))
    for i, row in enumerate(row_values):
        row_cells = [c for c in cells if row is None or c.labels[study.row_axis] == row]
        for cell in row_cells:
            label = _line_label(cell.labels, study.row_axis)
            color = colors[line_labels.index(label) % len(colors)]
            recs = [r for r in summary.completed if r.spec.display_cell.name == cell.name]
            if not recs:
                continue
            label = f"{label} (n={len(recs)})"
            for j, (key, _title) in enumerate(PANELS):
                ax = axes[i][j]
                keys = [("bapo/c_low", "--"), ("bapo/c_high", "-")] if key == "bounds" else [(key, "-")]
                for k, style in keys:
                    band = _band(recs, k, smooth=5 if k == "reward/mean" else 1)
                    if band is None:
                        continue
                    steps, mean, std = band
                    marker = "o" if k == "eval/avg_at_k" else None
                    ax.plot(
                        steps,
                        mean,
                        style,
                        color=color,
                        marker=marker,
                        ms=3,
                        label=label if (j == 0 and style == "-") else None,
                    )
                    ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.18, lw=0)
        for j, (_key, title) in enumerate(PANELS):
            ax = axes[i][j]
            ax.set_title(title + (f"\n{study.row_axis}={row}" if row is not None else ""), fontsize=9)
            ax.tick_params(labelsize=7)
            ax.set_xlabel("RL step", fontsize=8)
        axes[i][0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{study.name} ({summary.mode}): mean ± 1 std over seeds", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


SIGNATURE_PANELS = [
    ("share", "positive share at the fixed bounds\n(P / (P + N), 3-step mean)"),
    ("entropy", "token entropy"),
    ("lengths", "response length: right (solid) / wrong (dashed)"),
    ("rollout/truncated_fraction", "cut off at the length limit"),
    ("eval/avg_at_k", "held-out avg@k"),
]


def plot_signature(summary: StudySummary, path: Path, rho0: float = 0.4) -> Path | None:
    """The regime before any comparison: the baseline method's cells (one line per setting, e.g.
    staleness), with the share BAPO targets (rho0) drawn on the share panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = summary.study
    cells = [c for c in study.cells_for(summary.mode) if c.labels.get("method") == study.paired_against]
    if not cells:
        return None
    fig, axes = plt.subplots(1, len(SIGNATURE_PANELS), figsize=(3.4 * len(SIGNATURE_PANELS), 3.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ci, cell in enumerate(cells):
        recs = [r for r in summary.completed if r.spec.display_cell.name == cell.name]
        if not recs:
            continue
        label = f"{_line_label(cell.labels, 'method')} (n={len(recs)})"
        for ax, (key, _title) in zip(axes, SIGNATURE_PANELS):
            keys = (
                [("train/response_length_correct", "-"), ("train/response_length_wrong", "--")]
                if key == "lengths"
                else [(key, "-")]
            )
            for k, style in keys:
                band = _band(recs, k, smooth=3 if k in ("share", "train/response_length_correct") else 1)
                if band is None:
                    continue
                steps, mean, std = band
                ax.plot(
                    steps,
                    mean,
                    style,
                    color=colors[ci % len(colors)],
                    marker="o" if k == "eval/avg_at_k" else None,
                    ms=3,
                    label=label if style == "-" else None,
                )
                ax.fill_between(
                    steps, mean - std, mean + std, color=colors[ci % len(colors)], alpha=0.15, lw=0
                )
    for ax, (key, title) in zip(axes, SIGNATURE_PANELS):
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("RL step", fontsize=8)
        if key == "share":
            ax.axhline(rho0, color="black", ls=":", lw=1, label=f"rho0 = {rho0}")
            ax.axhline(0.5, color="grey", ls="--", lw=0.8, label="balanced (0.5)")
            ax.legend(fontsize=7)
    fig.suptitle(
        f"{study.name} ({summary.mode}): the regime under {study.paired_against} clip, mean ± 1 std over seeds",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_paired(differences: list[PairedDifference], title: str, path: Path) -> Path | None:
    """Paired differences against the baseline with their 95% intervals, one panel per statistic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not differences:
        return None
    n_rows = len({d.cell for d in differences})
    fig, axes = plt.subplots(1, len(PAIRED_KEYS), figsize=(3.6 * len(PAIRED_KEYS), 0.55 * n_rows + 1.6), sharey=True)
    for ax, (key, name) in zip(axes, PAIRED_KEYS):
        rows = [d for d in differences if d.key == key]
        ys = range(len(rows))
        for y, d in zip(ys, rows):
            if not math.isfinite(d.mean):
                continue
            lo = d.mean - d.low if math.isfinite(d.low) else 0
            hi = d.high - d.mean if math.isfinite(d.high) else 0
            helped = math.isfinite(d.low) and d.low > 0
            hurt = math.isfinite(d.high) and d.high < 0
            color = "tab:green" if helped else "tab:red" if hurt else "tab:grey"
            ax.errorbar([d.mean], [y], xerr=[[lo], [hi]], fmt="o", color=color, capsize=3)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(list(ys), [_short(d.cell) for d in rows], fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_title(name, fontsize=9)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _short(cell: str) -> str:
    """`updates=16/method=bapo` -> `16 updates, bapo` (tick labels)."""
    labels = dict(part.split("=", 1) for part in cell.split("/"))
    method = labels.pop("method", "")
    return ", ".join([*(f"{v} {k}" for k, v in labels.items()), method])


def plot_finals(summary: StudySummary, path: Path) -> Path:
    """Final held-out avg@k and final reward per cell, mean ± std over seeds: against the row axis (e.g.
    staleness) with one line per method, or one bar per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = summary.study
    cells = study.cells_for(summary.mode)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, title in (
        (axes[0], "heldout_end", "final held-out avg@k"),
        (axes[1], "reward_end", "final reward"),
    ):
        if study.row_axis:
            xs = list(dict.fromkeys(c.labels[study.row_axis] for c in cells))
            for label in dict.fromkeys(_line_label(c.labels, study.row_axis) for c in cells):
                pts = [
                    (i, summary.cells[c.name][key])
                    for i, x in enumerate(xs)
                    for c in cells
                    if c.labels[study.row_axis] == x and _line_label(c.labels, study.row_axis) == label
                ]
                pts = [(i, m, sd) for i, (m, sd, n) in pts if n]
                if pts:
                    ax.errorbar(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        yerr=[p[2] if math.isfinite(p[2]) else 0 for p in pts],
                        marker="o",
                        capsize=3,
                        label=label,
                    )
            ax.set_xticks(range(len(xs)), xs)
            ax.set_xlabel(study.row_axis)
            ax.legend(fontsize=8)
        else:
            names = [c.name for c in cells]
            means = [summary.cells[n][key][0] for n in names]
            stds = [summary.cells[n][key][1] for n in names]
            ax.bar(
                range(len(names)),
                [m if math.isfinite(m) else 0 for m in means],
                yerr=[sd if math.isfinite(sd) else 0 for sd in stds],
                capsize=3,
                color="tab:blue",
                alpha=0.7,
            )
            ax.set_xticks(
                range(len(names)),
                [n.split("=", 1)[-1] if "/" not in n else n for n in names],
                rotation=20,
                fontsize=7,
            )
        if key == "heldout_end":
            starts = [summary.cells[c.name]["heldout_start"][0] for c in cells]
            starts = [v for v in starts if math.isfinite(v)]
            if starts:
                ax.axhline(sum(starts) / len(starts), color="grey", ls=":", lw=1, label="after warm-up")
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"{study.name} ({summary.mode}): mean ± std over seeds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _line_label(labels: dict[str, str], row_axis: str | None) -> str:
    return "/".join(v for k, v in labels.items() if k != row_axis) or "all"


# ---- markdown ------------------------------------------------------------------------------------------------
def markdown_section(summary: StudySummary, figure: Path, doc_dir: Path) -> str:
    study, budget = summary.study, summary.budget
    n_total, n_done = len(summary.records), len(summary.completed)
    lines = [
        f"### {study.name} ({summary.mode})",
        "",
        study.description,
        "",
        (
            f"{budget.max_steps} RL steps per run, seeds {list(budget.seeds)}, held-out avg@k every "
            f"{budget.eval_every} steps. **Completed runs: {n_done} of {n_total}.**"
        ),
    ]
    if summary.missing:
        lines.append(
            "Not completed (excluded from the table and plots): "
            + "; ".join(
                f"`{r.spec.display_cell.name}` seed {r.spec.seed} ({r.reason})" for r in summary.missing
            )
        )
    reused = {
        r.spec.display_cell.name: f"{r.spec.study}/{r.spec.cell.name}"
        for r in summary.records
        if r.spec.shown_as
    }
    if reused:
        lines.append(
            "Reused runs (same settings, run once): "
            + "; ".join(f"`{mine}` = `{theirs}`" for mine, theirs in reused.items())
            + "."
        )
    timed = [r.seconds for r in summary.completed if r.seconds]
    spans = [(r.start_ms, r.end_ms) for r in summary.completed if r.start_ms and r.end_ms]
    if timed:
        lines.append(
            f"Run time: {sum(timed) / 60:.1f} min summed over runs, {sum(timed) / len(timed):.0f} s per "
            "run on average (including its share of evaluations, excluding the shared warm-up)"
            + (
                f"; wall clock first start to last end {(max(e for _, e in spans) - min(s for s, _ in spans)) / 60000:.1f} min."
                if spans
                else "."
            )
        )
    commits = sorted({r.commit for r in summary.completed if r.commit})
    if commits:
        dirty = any(c.endswith("+dirty") for c in commits)
        lines.append(
            f"Code: commit{'s' if len(commits) > 1 else ''} {', '.join(commits)} (MLflow tag `git.commit`"
            + ("; +dirty: run from a working tree with uncommitted changes)." if dirty else ").")
        )
    rel = figure.relative_to(doc_dir) if figure.is_relative_to(doc_dir) else figure
    finals = rel.with_name(rel.stem + "_final.png")
    lines += [
        "",
        f"![{study.name}: final values]({finals.as_posix()})",
        "",
        f"![{study.name}]({rel.as_posix()})",
        "",
        (
            "| cell | n | held-out avg@k start → end | held-out gain | final reward | entropy start → end | "
            "collapsed | c_low | c_high | rho | target met | grad norm |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in study.cells_for(summary.mode):
        s = summary.cells[cell.name]
        n = s["heldout_end"][2]
        if n == 0:
            lines.append(f"| {cell.name} | 0 | — | — | — | — | — | — | — | — | — | — |")
            continue
        collapsed = f"{round(s['collapsed'][0] * s['collapsed'][2])}/{s['collapsed'][2]}"
        searched = cell.overrides.get("loss_fn.bapo.enabled", True)  # fixed bounds: no search, no target
        target = fmt(*s["target_met"][:2], 2) if searched else "n/a"
        lines.append(
            f"| {cell.name} | {n} | {fmt(*s['heldout_start'][:2])} → {fmt(*s['heldout_end'][:2])} | "
            f"{fmt(*s['heldout_gain'][:2], signed=True)} | {fmt(*s['reward_end'][:2])} | {fmt(*s['entropy_start'][:2])} → {fmt(*s['entropy_end'][:2])} | "
            f"{collapsed} | {fmt(*s['c_low'][:2], 2)} | {fmt(*s['c_high'][:2], 2)} | {fmt(*s['rho'][:2])} | "
            f"{target} | {fmt(*s['grad_norm'][:2])} |"
        )
    if study.paired_against is not None:
        lines += _paired_markdown(summary, rel)
    return "\n".join(lines) + "\n"


def _paired_markdown(summary: StudySummary, figure_rel: Path) -> list[str]:
    """The signature table of the baseline's cells and the paired differences against them."""
    study = summary.study
    base_cells = [c for c in study.cells_for(summary.mode) if c.labels.get("method") == study.paired_against]
    lines = [
        "",
        f"Signature of the regime under {study.paired_against} clip (means over RL steps, then mean ± std over seeds):",
        "",
        f"![{study.name}: signature]({figure_rel.with_name(figure_rel.stem + '_signature.png').as_posix()})",
        "",
        "| cell | n | positive share P/(P+N) | wrong / right response length | held-out gain | entropy start → end | collapsed |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in base_cells:
        s = summary.cells[cell.name]
        n = s["heldout_end"][2]
        collapsed = f"{round(s['collapsed'][0] * n)}/{n}" if n else "—"
        lines.append(
            f"| {cell.name} | {n} | {fmt(*s['share'][:2])} | {fmt(*s['length_wrong_over_correct'][:2], 2)} | "
            f"{fmt(*s['heldout_gain'][:2], signed=True)} | {fmt(*s['entropy_start'][:2])} → "
            f"{fmt(*s['entropy_end'][:2])} | {collapsed} |"
        )
    differences = summary.paired
    lines += [
        "",
        (
            f"Paired differences against {study.paired_against} clip at the same staleness, seed by seed "
            "(mean and 95% Student-t interval; an interval that excludes 0 is a difference at this n):"
        ),
        "",
        f"![{study.name}: paired differences]({figure_rel.with_name(figure_rel.stem + '_paired.png').as_posix()})",
        "",
        "| cell | n | " + " | ".join(name for _, name in PAIRED_KEYS) + " |",
        "|---|---|" + "---|" * len(PAIRED_KEYS),
    ]
    for cell in dict.fromkeys(d.cell for d in differences):
        row = {d.key: d for d in differences if d.cell == cell}
        n = max(d.n for d in row.values())
        cells = []
        for key, _ in PAIRED_KEYS:
            d = row[key]
            interval = f" [{d.low:+.3f}, {d.high:+.3f}]" if math.isfinite(d.low) else ""
            cells.append(f"{d.mean:+.3f}{interval}" if math.isfinite(d.mean) else "—")
        lines.append(f"| {cell} | {n} | " + " | ".join(cells) + " |")
    return lines


def update_doc(doc: Path, key: str, body: str) -> None:
    """Replace the generated block `key` in `doc` (or append it); everything outside the markers is kept."""
    begin, end = f"<!-- BEGIN generated {key} -->", f"<!-- END generated {key} -->"
    text = doc.read_text() if doc.is_file() else "# Results\n"
    block = f"{begin}\n{body}{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    text = (
        pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + f"\n\n{block}\n"
    )
    doc.write_text(text)


def write_outputs(summary: StudySummary, docs: Path = DOCS) -> tuple[Path, Path]:
    out_dir = docs / "results" / summary.mode
    figure = plot_study(summary, out_dir / f"{summary.study.name}.png")
    plot_finals(summary, out_dir / f"{summary.study.name}_final.png")
    if summary.study.paired_against is not None:
        plot_signature(summary, out_dir / f"{summary.study.name}_signature.png")
        plot_paired(
            summary.paired,
            f"{summary.study.name} ({summary.mode}): difference vs {summary.study.paired_against} clip, "
            "same seed (95% t interval)",
            out_dir / f"{summary.study.name}_paired.png",
        )
    data = {
        "study": summary.study.name,
        "mode": summary.mode,
        "max_steps": summary.budget.max_steps,
        "seeds": list(summary.budget.seeds),
        "completed": [r.spec.run_name for r in summary.completed],
        "not_completed": {r.spec.run_name: r.reason for r in summary.missing},
        "cells": {
            name: {k: {"mean": _json_num(m), "std": _json_num(s), "n": n} for k, (m, s, n) in stats.items()}
            for name, stats in summary.cells.items()
        },
        "runs": {
            name: {k: _json_num(v) for k, v in stats.items()} for name, stats in summary.per_run.items()
        },
        "run_seconds": {r.spec.run_name: r.seconds for r in summary.completed if r.seconds},
        "paired_differences": [
            {**d.__dict__, **{k: _json_num(getattr(d, k)) for k in ("mean", "low", "high")}}
            for d in summary.paired
        ],
    }
    table = out_dir / f"{summary.study.name}.json"
    table.write_text(json.dumps(data, indent=1) + "\n")
    update_doc(
        docs / "results.md", f"{summary.mode}/{summary.study.name}", markdown_section(summary, figure, docs)
    )
    return figure, table


def _json_num(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.summarize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "studies", nargs="+", metavar="STUDY", help=f"one or more of: {', '.join(STUDIES)}, or all"
    )
    parser.add_argument("--quick", action="store_true", help="summarize the --quick runs")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--docs", type=Path, default=DOCS, help="where results.md and results/ go")
    args = parser.parse_args(argv)
    names = list(STUDIES) if args.studies == ["all"] else args.studies
    for name in names:
        if name not in STUDIES:
            parser.error(f"unknown study {name!r}; choose from: {', '.join(STUDIES)} (or all)")
    mode = "quick" if args.quick else "full"
    for name in names:
        summary = summarize_study(name, mode, args.root)
        figure, table = write_outputs(summary, args.docs)
        print(
            f"{name} ({mode}): {len(summary.completed)}/{len(summary.records)} runs completed -> {figure}, {table}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
