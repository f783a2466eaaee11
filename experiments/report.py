"""The Markdown of a study summary: its section of docs/results.md (the runs, the table of per-cell
statistics, and for paired studies the signature and paired-difference tables), written between
`<!-- BEGIN generated KEY -->` and `<!-- END generated KEY -->` so that the prose around it is kept."""

from __future__ import annotations

import math
import re
from pathlib import Path

from experiments.study_summary import PAIRED_KEYS, StudySummary, fmt


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
