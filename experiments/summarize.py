"""Tables and plots of finished studies, read from their MLflow stores:
`python -m experiments.summarize STUDY [STUDY ...|all] [--quick]`.

For each study: which runs completed (and which did not), per-run statistics, their mean +- std over
seeds per cell (experiments/study_summary.py), a figure of the curves (mean line, +-1 std band over seeds;
experiments/figures.py), and a generated section of docs/results.md (between
`<!-- BEGIN generated MODE/STUDY -->` and `<!-- END ... -->`; the prose around it is kept;
experiments/report.py). Files: docs/results/<mode>/<study>.png and docs/results/<mode>/<study>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from experiments import study_summary
from experiments.figures import plot_finals, plot_paired, plot_signature, plot_study
from experiments.grid import STUDIES
from experiments.report import markdown_section, update_doc
from experiments.run import DEFAULT_ROOT
from experiments.study_summary import StudySummary, summarize_study

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


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
        description=f"{__doc__}\n{study_summary.__doc__}",
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
