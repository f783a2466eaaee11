"""The figures of a study summary (matplotlib, written as PNG): the curves of every cell (mean line, +-1 std
band over seeds), the final values per cell, and for paired studies the baseline's signature and the paired
differences with their 95% intervals."""

from __future__ import annotations

import math
from pathlib import Path

from experiments.study_summary import (
    PAIRED_KEYS,
    History,
    PairedDifference,
    RunRecord,
    StudySummary,
    line_label,
)

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


def _pyplot():
    """matplotlib's pyplot on the file-only backend (no display on a cluster node or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    plt = _pyplot()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_study(summary: StudySummary, path: Path) -> Path:
    plt = _pyplot()

    study = summary.study
    cells = study.cells_for(summary.mode)
    row_values = list(dict.fromkeys(c.labels[study.row_axis] for c in cells)) if study.row_axis else [None]
    fig, axes = plt.subplots(
        len(row_values), len(PANELS), figsize=(3.3 * len(PANELS), 2.6 * len(row_values)), squeeze=False
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    line_labels = list(dict.fromkeys(line_label(c.labels, study.row_axis) for c in cells))
    for i, row in enumerate(row_values):
        row_cells = [c for c in cells if row is None or c.labels[study.row_axis] == row]
        for cell in row_cells:
            label = line_label(cell.labels, study.row_axis)
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
    return _save(fig, path)


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
    plt = _pyplot()

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
        label = f"{line_label(cell.labels, 'method')} (n={len(recs)})"
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
    return _save(fig, path)


def plot_paired(differences: list[PairedDifference], title: str, path: Path) -> Path | None:
    """Paired differences against the baseline with their 95% intervals, one panel per statistic."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    if not differences:
        return None
    n_rows = len({d.cell for d in differences})
    fig, axes = plt.subplots(
        1, len(PAIRED_KEYS), figsize=(3.6 * len(PAIRED_KEYS), 0.55 * n_rows + 1.6), sharey=True
    )
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
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def _short(cell: str) -> str:
    """`updates=16/method=bapo` -> `16 updates, bapo` (tick labels)."""
    labels = dict(part.split("=", 1) for part in cell.split("/"))
    method = labels.pop("method", "")
    return ", ".join([*(f"{v} {k}" for k, v in labels.items()), method])


def plot_finals(summary: StudySummary, path: Path) -> Path:
    """Final held-out avg@k and final reward per cell, mean ± std over seeds: against the row axis (e.g.
    staleness) with one line per method, or one bar per cell."""
    plt = _pyplot()

    study = summary.study
    cells = study.cells_for(summary.mode)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, title in (
        (axes[0], "heldout_end", "final held-out avg@k"),
        (axes[1], "reward_end", "final reward"),
    ):
        if study.row_axis:
            xs = list(dict.fromkeys(c.labels[study.row_axis] for c in cells))
            for label in dict.fromkeys(line_label(c.labels, study.row_axis) for c in cells):
                pts = [
                    (i, summary.cells[c.name][key])
                    for i, x in enumerate(xs)
                    for c in cells
                    if c.labels[study.row_axis] == x and line_label(c.labels, study.row_axis) == label
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
    return _save(fig, path)
