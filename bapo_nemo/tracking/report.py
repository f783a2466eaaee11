"""Training-dynamics report for several MLflow runs side by side: the BAPO paper's panels (reward, entropy,
positive contribution rho, clip bounds, grad norm, response length, held-out accuracy) as one PNG and
one self-contained HTML page (images inlined as base64, a table of key params and final metrics).

Metric names are the embedded trainer's; NeMo-RL v0.7.0's names (``train/`` and ``validation/``
prefixes, its own spellings) are accepted through ``ALIASES``: the first name a run has is used.
"""

from __future__ import annotations

import base64
import html
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from bapo_nemo.tracking.redact import redact_text
from bapo_nemo.tracking.report_stats import (
    comparison_lines,
    heldout_points,
    measure_of,
    median_counted,
    sample_label,
)

# canonical name -> names tried in order (embedded trainer first, then NeMo-RL v0.7.0 with our loss)
ALIASES: dict[str, list[str]] = {
    "reward/mean": ["reward/mean", "train/reward", "reward"],
    "frac_reward_zero_std": ["frac_reward_zero_std", "train/frac_reward_zero_std"],  # TRL's name
    "entropy": ["entropy", "train/entropy", "train/approx_entropy"],
    "bapo/rho": ["bapo/rho", "train/bapo/rho"],
    "bapo/rho_initial": ["bapo/rho_initial", "train/bapo/rho_initial"],
    "bapo/c_low": ["bapo/c_low", "train/bapo/c_low"],
    "bapo/c_high": ["bapo/c_high", "train/bapo/c_high"],
    "grad_norm": ["grad_norm", "train/grad_norm"],
    "response_length/mean": ["response_length/mean", "train/response_length_mean",
                             "train/mean_gen_tokens_per_sample"],
    "heldout/avg@k": ["heldout/avg@k", "eval/avg_at_k", "validation/accuracy"],
}


# Series read to say what the drawn ones count (the held-out sample, the tokens rho is measured over); never
# drawn or tabled themselves.
DETAIL_ALIASES: dict[str, list[str]] = {
    "heldout/stderr": ["eval/avg_at_k_stderr"],
    "heldout/prompts": ["eval/num_prompts"],
    "heldout/k": ["eval/samples_per_prompt"],
    **{f"bapo/{name}": [f"bapo/{name}", f"train/bapo/{name}"]
       for name in ("tokens_pos", "tokens_neg", "clipfrac_pos", "clipfrac_neg", "clipfrac_dual")},
}


@dataclass(frozen=True)
class Panel:
    title: str
    metrics: tuple[str, ...]  # canonical names drawn in this panel
    ylabel: str
    every_step: bool = True  # logged at every step: a step without a value is drawn as a gap
    share: bool = False  # values are shares or rates in [0, 1]: the axis spans [0, 1] when they fit


PANELS = [
    Panel("Training reward", ("reward/mean", "frac_reward_zero_std"), "mean reward; share of groups", share=True),
    Panel("Held-out avg@k", ("heldout/avg@k",), "avg@k", every_step=False, share=True),
    Panel("Policy entropy", ("entropy",), "nats / token"),
    Panel("Positive share rho", ("bapo/rho", "bapo/rho_initial"), "P / (P + N)", share=True),
    Panel("Clip bounds", ("bapo/c_high", "bapo/c_low"), "ratio bound"),
    Panel("Gradient norm", ("grad_norm",), "global L2 norm"),
    Panel("Response length", ("response_length/mean",), "tokens"),
]
# Line style and in-panel legend label of each series of a panel with several; colour is the run's.
SERIES_STYLE = {
    "reward/mean": ("-", "mean reward"),
    "frac_reward_zero_std": ("--", "groups with zero reward spread"),
    "bapo/rho": ("-", "rho at the chosen bounds"),
    "bapo/rho_initial": (":", "rho at the starting bounds"),
    "bapo/c_high": ("-", "c_high"),
    "bapo/c_low": ("--", "c_low"),
}
# Under the clip-bounds panel: why bounds that jump between the ends of their range every step are healthy.
CLIP_BOUNDS_NOTE = ("jumps between the grid's ends (c_high 1.2 <-> 3.0) are expected: each update re-picks\n"
                    "its bounds; with the share near rho0, some updates need none widened, others the widest")
# A y-range narrower than this share of the values' size is widened to it: a flat curve reads as flat,
# and tick labels never need an offset (matplotlib's "1e-5+6.1347").
MIN_RELATIVE_SPAN = 0.01

KEY_PARAMS = ["bapo.enabled", "bapo.rho0", "bapo.order", "bapo.measure", "bapo.granularity", "bapo.c_low_min",
              "bapo.c_low_max", "bapo.c_high_min", "bapo.c_high_max", "bapo.dual_clip", "optim.lr",
              "optimizer.kwargs.lr", "train.updates_per_batch", "policy.model_name", "ratio_clip_min",
              "ratio_clip_max"]


class ReportError(ValueError):
    """Unknown experiment or run; the message lists what exists."""


@dataclass
class RunData:
    run_id: str
    name: str
    status: str
    params: dict[str, str]
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # canonical -> (step, value)
    source_names: dict[str, str] = field(default_factory=dict)  # canonical -> the run's metric name

    @property
    def label(self) -> str:
        return f"{self.name} ({self.run_id[:8]})"

    def final(self, canonical: str) -> float | None:
        points = self.series.get(canonical)
        return points[-1][1] if points else None


def find_experiment(client, name: str):
    experiment = client.get_experiment_by_name(name)
    if experiment is None or experiment.lifecycle_stage == "deleted":
        names = sorted(e.name for e in client.search_experiments())
        raise ReportError(f"no MLflow experiment named {name!r} at {redact_text(client.tracking_uri)}; "
                          "experiments there: "
                          f"{', '.join(names) if names else '(none)'}")
    return experiment


def select_runs(client, experiment, wanted: list[str] | None, max_runs: int = 1000):
    """Runs of the experiment, newest first; ``wanted`` picks by run id or run name (in the given order)."""
    runs = client.search_runs([experiment.experiment_id], max_results=max_runs, order_by=["attributes.start_time DESC"])
    if not runs:
        raise ReportError(f"experiment {experiment.name!r} has no runs")
    if not wanted:
        return runs
    chosen, unknown = [], []
    for key in wanted:
        matches = [r for r in runs if r.info.run_id == key or r.info.run_name == key]
        if not matches:
            unknown.append(key)
        elif len(matches) > 1 and matches[0].info.run_id != key:
            raise ReportError(f"run name {key!r} is ambiguous in {experiment.name!r}: "
                              f"{', '.join(r.info.run_id for r in matches)}; pass a run id")
        else:
            chosen.append(matches[0])
    if unknown:
        listing = "; ".join(f"{r.info.run_name} ({r.info.run_id})" for r in runs[:50])
        raise ReportError(f"no run {', '.join(map(repr, unknown))} in experiment {experiment.name!r}; runs there: {listing}")
    return chosen


def load_run(client, run) -> RunData:
    data = RunData(run.info.run_id, run.info.run_name or run.info.run_id, run.info.status, dict(run.data.params))
    available = set(run.data.metrics)
    for canonical, names in {**ALIASES, **DETAIL_ALIASES}.items():
        name = next((n for n in names if n in available), None)
        if name is None:
            continue
        history = client.get_metric_history(run.info.run_id, name)
        points = sorted({(m.step, m.value) for m in history if not math.isnan(m.value)}, key=lambda p: p[0])
        data.series[canonical], data.source_names[canonical] = points, name
    return data


def key_params(params: dict[str, str]) -> dict[str, str]:
    out = {}
    for suffix in KEY_PARAMS:
        for key, value in params.items():
            if key == suffix or key.endswith("." + suffix):
                out[suffix] = value
                break
    return out


def target_shares(runs: list[RunData]) -> list[float]:
    """The distinct rho0 targets of the runs that search their bounds (BAPO enabled), for the rho panel."""
    targets = []
    for run in runs:
        params = key_params(run.params)
        if params.get("bapo.enabled", "True").lower() != "true" or "bapo.rho0" not in params:
            continue
        try:
            rho0 = float(params["bapo.rho0"])
        except ValueError:
            continue
        if rho0 not in targets:
            targets.append(rho0)
    return targets


def plot_panels(runs: list[RunData], path: Path) -> list[Panel]:
    """The figure of `draw_panels`, saved as a PNG at `path`; returns the panels drawn."""
    fig, panels = draw_panels(runs)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return panels


def draw_panels(runs: list[RunData]):
    """(figure, panels): one panel per quantity some run logged; a panel no run has data for is left out
    and named, with the reason, under the figure (never an empty panel). A run has one colour in every
    panel; the series of a panel with several (rho at the chosen and starting bounds, c_high and c_low, ...)
    differ by line style, named in the panel's own legend. Held-out points carry their 95% interval and the
    panel names their sample; the rho panel names the tokens each run's share is over. Shares keep the
    axis [0, 1], so noise is not magnified into a gap. One run is named in the title, several in a legend of
    colours below the panels."""
    panels = [p for p in PANELS if any(r.series.get(m) for r in runs for m in p.metrics)]
    left_out = [f"{p.title} ({_why_empty(p, runs)})" for p in PANELS if p not in panels]
    cols = 4 if len(panels) > 6 else 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        drawn, extra = set(), []
        for i, run in enumerate(runs):
            colour = colours[i % len(colours)]
            if panel.metrics == ("heldout/avg@k",):
                drawn |= _draw_heldout(ax, run, colour)
                continue
            grid = [s for s, _ in run.series.get("reward/mean", [])] if panel.every_step else []
            for metric in panel.metrics:
                points = run.series.get(metric)
                if not points:
                    continue
                steps, values = zip(*_with_gaps(points, grid))
                ax.plot(steps, values, SERIES_STYLE.get(metric, ("-",))[0], color=colour,
                        marker="o" if len(points) < 15 else None, markersize=3)
                drawn.add(metric)
        ax.set_title(panel.title)
        handles = [Line2D([], [], color="dimgrey", ls=SERIES_STYLE[m][0], label=SERIES_STYLE[m][1])
                   for m in panel.metrics if m in drawn and len(panel.metrics) > 1]
        if "bapo/rho" in panel.metrics:
            for rho0 in target_shares(runs):
                handles.append(ax.axhline(rho0, color="black", ls=":", lw=1, label=f"target rho0 = {rho0:g}"))
            extra = _counted_handles(runs, colours)
        elif panel.metrics == ("heldout/avg@k",):
            extra = _heldout_handles(ax, runs)
        elif "bapo/c_high" in panel.metrics and "bapo/c_high" in drawn:
            extra = [Line2D([], [], ls="none", label=CLIP_BOUNDS_NOTE)]
        if len(handles) > 1 or extra:  # under the panel, clear of its curves
            ax.legend(handles=handles + extra, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2),
                      ncol=1 if extra else 2, frameon=False)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        _honest_y(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if len(runs) == 1:
        fig.suptitle(f"run {runs[0].label}", fontsize=11)
    run_rows = 0
    if len(runs) > 1:
        run_rows = math.ceil(len(runs) / 4)
        handles = [Line2D([], [], color=colours[i % len(colours)], label=run.label) for i, run in enumerate(runs)]
        fig.legend(handles=handles, loc="lower center", ncol=min(len(runs), 4), fontsize=8, title="runs",
                   bbox_to_anchor=(0.5, -0.04 - 0.03 * run_rows))
    fig.tight_layout()
    if left_out:
        fig.text(0.01, -0.08 - 0.04 * run_rows, "not drawn: " + "; ".join(left_out), fontsize=8, color="dimgrey",
                 ha="left", va="top", wrap=True)
    return fig, panels


def _draw_heldout(ax, run: RunData, colour) -> set[str]:
    """The run's held-out points with their 95% intervals (dashed bars: only a bound was known)."""
    points = heldout_points(run)
    if not points:
        return set()
    steps, values = [p.step for p in points], [p.value for p in points]
    ax.plot(steps, values, "-o", color=colour, markersize=3)
    known = [p for p in points if p.half_width is not None]
    if known:
        bars = ax.errorbar([p.step for p in known], [p.value for p in known], yerr=[p.half_width for p in known],
                           fmt="none", ecolor=colour, elinewidth=1, capsize=3, alpha=0.8)
        if any(p.bound for p in known):
            bars[2][0].set_linestyle("--")
    return {"heldout/avg@k"}


def _heldout_handles(ax, runs: list[RunData]) -> list:
    """What the held-out panel's points are: the sample (in the title when the runs share one) and the bars."""
    labels = {sample_label(heldout_points(r)) for r in runs if r.series.get("heldout/avg@k")}
    if len(labels) == 1 and None not in labels:
        ax.set_title(f"Held-out avg@k ({labels.pop()})")
        handles = []
    else:
        handles = [Line2D([], [], ls="none", label=f"{r.name}: {sample_label(heldout_points(r)) or 'sample size not logged'}")
                   for r in runs if r.series.get("heldout/avg@k")]
    points = [p for r in runs for p in heldout_points(r)]
    if any(p.half_width is not None for p in points):
        bound = " (dashed: the widest n prompts allow)" if any(p.bound for p in points) else ""
        handles.append(Line2D([], [], color="dimgrey", marker="|", ls="none", markersize=10,
                              label=f"bars: 95% interval over prompts{bound}"))
    return handles


def _counted_handles(runs: list[RunData], colours) -> list:
    """Legend entries naming the tokens each run's rho is measured over (median per update)."""
    handles = []
    for i, run in enumerate(runs):
        count = median_counted(run)
        if count is None:
            continue
        who = f"{run.name}: " if len(runs) > 1 else ""
        what = "tokens with A != 0" if measure_of(run) == "value" else "tokens with gradient"
        handles.append(Line2D([], [], color=colours[i % len(colours)], lw=3, alpha=0.5,
                              label=f"{who}over ~{count:.0f} {what} per update"))
    counts = [median_counted(r) for r in runs]
    counts = [c for c in counts if c is not None]
    if len(counts) > 1 and max(counts) > 1.5 * min(counts):
        handles.append(Line2D([], [], ls="none", label="shares over different token sets"))
    return handles


def _honest_y(ax, panel: Panel) -> None:
    """A share panel whose values (and interval bars) all lie in [0, 1] spans [0, 1], so a small
    difference is drawn small; other panels get `_readable_y`."""
    low, high = ax.dataLim.y0, ax.dataLim.y1
    if panel.share and low >= 0.0 and high <= 1.0:
        ax.set_ylim(-0.03, 1.03)
        ax.ticklabel_format(axis="y", useOffset=False)
        return
    _readable_y(ax)


def _why_empty(panel: Panel, runs: list[RunData]) -> str:
    no_spread = all(v == 1.0 for r in runs for _, v in r.series.get("frac_reward_zero_std", [(0, 0.0)]))
    if "bapo/rho" in panel.metrics and no_spread:
        return "undefined in every step: each group's responses all got the same reward"
    return "not logged by these runs"


def _with_gaps(points: list[tuple[int, float]], grid: list[int]) -> list[tuple[int, float]]:
    """`points` with NaN at the steps of `grid` (the run's logged steps) inside their span that have no
    value, so the line breaks there (e.g. rho in a step where no group had any reward spread)."""
    if not grid:
        return points
    have = dict(points)
    first, last = points[0][0], points[-1][0]
    return sorted({**have, **{s: math.nan for s in grid if first <= s <= last and s not in have}}.items())


def _readable_y(ax) -> None:
    """Plain tick labels (no offset) and a y-range at least MIN_RELATIVE_SPAN of the values' size."""
    ax.ticklabel_format(axis="y", useOffset=False)
    low, high = ax.get_ylim()
    centre = (low + high) / 2
    half = MIN_RELATIVE_SPAN * abs(centre) / 2
    if high - low < 2 * half:
        ax.set_ylim(centre - half, centre + half)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def render_html(experiment_name: str, runs: list[RunData], png: Path, tracking_uri: str) -> str:
    image = base64.b64encode(png.read_bytes()).decode()
    params = [key_params(r.params) for r in runs]
    param_names = [k for k in KEY_PARAMS if any(k in p for p in params)]
    final_names = [c for c in ALIASES if any(r.series.get(c) for r in runs)]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in ["run", "run id", "status", *param_names,
                                                           *(f"final {c}" for c in final_names)])
    rows = []
    for run, p in zip(runs, params):
        cells = [run.name, run.run_id, run.status, *(p.get(k) for k in param_names),
                 *(run.final(c) for c in final_names)]
        rows.append("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in cells) + "</tr>")
    sources = sorted({f"{c} &larr; {n}" for r in runs for c, n in r.source_names.items() if c != n})
    alias_note = f"<p>Metric names mapped: {', '.join(sources)}</p>" if sources else ""
    said = comparison_lines(runs)
    comparison = f"<h2>In numbers</h2>\n<pre>{html.escape(chr(10).join(said))}</pre>\n" if said else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>BAPO report: {html.escape(experiment_name)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}th{{background:#f3f3f3}}img{{max-width:100%}}</style>
</head><body>
<h1>Training dynamics: {html.escape(experiment_name)}</h1>
<p>{len(runs)} runs from <code>{html.escape(redact_text(tracking_uri))}</code>.</p>
<img alt="training dynamics" src="data:image/png;base64,{image}">
{comparison}<h2>Runs</h2>
<table><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
{alias_note}
</body></html>
"""


@dataclass
class ReportResult:
    png: Path
    html: Path
    runs: list[RunData]


def build_report(tracking_uri: str, experiment_name: str, runs: list[str] | None, out_dir: str | Path,
                 log_to_runs: bool = True, progress: bool = True) -> ReportResult:
    from mlflow.tracking import MlflowClient
    from tqdm import tqdm

    from bapo_nemo.tracking.store import HTTP_ENV_DEFAULTS, check_tracking_uri, is_remote

    if is_remote(check_tracking_uri(tracking_uri)):
        for var, value in HTTP_ENV_DEFAULTS.items():  # fail in seconds, not minutes, when the server is down
            os.environ.setdefault(var, value)
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri[len("sqlite:///"):]).is_file():
        # MLflow would silently create an empty database at a mistyped path
        raise ReportError(f"no MLflow database at {tracking_uri[len('sqlite:///'):]}: check --tracking-uri "
                          "(the embedded trainer's is sqlite:///<output_dir>/mlflow.db)")
    client = MlflowClient(tracking_uri)
    try:
        experiment = find_experiment(client, experiment_name)
    except ReportError:
        raise
    except Exception as exc:  # any client failure here means the store is unusable
        raise ReportError(f"cannot read the MLflow store at {redact_text(tracking_uri)}: "
                          f"{redact_text(str(exc).splitlines()[0][:300])}") from exc
    selected = select_runs(client, experiment, runs)
    data = [load_run(client, r) for r in tqdm(selected, desc="reading runs", disable=not progress)]
    if not any(d.series for d in data):
        raise ReportError(f"none of the selected runs of {experiment_name!r} logged any of: {', '.join(ALIASES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "training_dynamics.png"
    plot_panels(data, png)
    page = out / "report.html"
    page.write_text(render_html(experiment_name, data, png, tracking_uri))
    if log_to_runs:
        for run in tqdm(data, desc="logging report to runs", disable=not progress):
            client.log_artifact(run.run_id, str(png), "report")
            client.log_artifact(run.run_id, str(page), "report")
    return ReportResult(png, page, data)


def log_run_plot(tracking_uri: str, run_id: str, out_dir: str | Path) -> Path:
    """The training-dynamics panels of one run, saved to ``out_dir`` and logged to the run as
    ``plots/training_dynamics.png`` (for a trainer to call when it finishes)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    data = load_run(client, client.get_run(run_id))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "training_dynamics.png"
    plot_panels([data], png)
    client.log_artifact(run_id, str(png), "plots")
    return png
