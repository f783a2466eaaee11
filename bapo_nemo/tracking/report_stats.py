"""What the report says about the numbers it draws: each held-out point's sample and interval
(`heldout_points`), the tokens BAPO's positive share was measured over (`counted_tokens`), and the
comparison of runs in words (`comparison_lines`). Held-out avg@k's unit is the prompt: the interval is
+-1.96 standard errors over prompts (`eval/avg_at_k_stderr`); a run with only the sample size gets the
widest interval n prompts allow for rewards in [0, 1] (sqrt(p (1 - p) / n)); with neither, no interval.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

Z95 = 1.96  # two-sided 95% normal quantile


@dataclass(frozen=True)
class HeldoutPoint:
    step: int
    value: float
    half_width: float | None  # of the 95% interval; None: unknown
    prompts: int | None
    samples: int | None
    bound: bool  # the half-width is the bound for rewards in [0, 1], not the measured standard error


def heldout_points(run) -> list[HeldoutPoint]:
    """The run's held-out points with their sample and interval."""
    stderr = dict(run.series.get("heldout/stderr", []))
    prompts = dict(run.series.get("heldout/prompts", []))
    samples = dict(run.series.get("heldout/k", []))
    points = []
    for step, value in run.series.get("heldout/avg@k", []):
        n = int(prompts[step]) if step in prompts else None
        k = int(samples[step]) if step in samples else None
        if step in stderr:
            half, bound = Z95 * stderr[step], False
        elif n and 0.0 <= value <= 1.0:
            half, bound = Z95 * math.sqrt(value * (1.0 - value) / n), True
        else:
            half, bound = None, False
        points.append(HeldoutPoint(step, value, half, n, k, bound))
    return points


def sample_label(points: list[HeldoutPoint]) -> str | None:
    """`64 prompts x 4 samples` when every point of the list has that sample, else None."""
    sizes = {(p.prompts, p.samples) for p in points}
    if len(sizes) != 1 or None in next(iter(sizes)):
        return None
    n, k = next(iter(sizes))
    return f"{n} prompts x {k} samples"


def counted_tokens(run) -> list[tuple[int, float]]:
    """Per step, the tokens BAPO's positive share rho = P / (P + N) was measured over (per update): with
    the gradient measure (the default) the tokens that still carry gradient at the chosen bounds, positive
    ones at or under c_high and negative ones at or over c_low (under the dual clip); with the value
    measure every token with a non-zero advantage. Runs whose bounds differ count different tokens."""
    pos, neg = dict(run.series.get("bapo/tokens_pos", [])), dict(run.series.get("bapo/tokens_neg", []))
    clip_pos, clip_neg = dict(run.series.get("bapo/clipfrac_pos", [])), dict(run.series.get("bapo/clipfrac_neg", []))
    clip_dual = dict(run.series.get("bapo/clipfrac_dual", []))
    value_measure = measure_of(run) == "value"
    out = []
    for step, _ in run.series.get("bapo/rho", []):
        if step not in pos or step not in neg:
            continue
        if value_measure:
            out.append((step, pos[step] + neg[step]))
        elif step in clip_pos and step in clip_neg:
            kept_neg = 1.0 - clip_neg[step] - clip_dual.get(step, 0.0)
            out.append((step, pos[step] * (1.0 - clip_pos[step]) + neg[step] * kept_neg))
    return out


def measure_of(run) -> str:
    """The run's BAPO measure (`loss_fn.bapo.measure`; the default, gradient, when it logged none)."""
    return next((v for k, v in run.params.items() if k.endswith("bapo.measure")), "gradient")


def median_counted(run) -> float | None:
    counts = [c for _, c in counted_tokens(run)]
    return statistics.median(counts) if counts else None


def comparison_lines(runs) -> list[str]:
    """The runs side by side in words: held-out avg@k at its first and last point with 95% intervals and
    the sample, and the tokens each run's rho counts."""
    lines = []
    with_heldout = [(run, heldout_points(run)) for run in runs if run.series.get("heldout/avg@k")]
    if with_heldout:
        samples = {sample_label(points) for _, points in with_heldout}
        shared = samples.pop() if len(samples) == 1 else None
        lines.append("held-out avg@k, 95% interval over prompts" + (f" ({shared})" if shared else "") + ":")
        width = max(len(run.label) for run, _ in with_heldout)
        for run, points in with_heldout:
            first, last = points[0], points[-1]
            text = f"  {run.label:<{width}}  {_point(first)}"
            if last.step != first.step:
                text += f" -> {_point(last)} ({last.value - first.value:+.3f})"
            if not shared:
                text += f"   [{sample_label(points) or 'sample size not logged'}]"
            lines.append(text)
        halves = [p.half_width for _, points in with_heldout for p in points if p.half_width is not None]
        if halves:
            lines.append(f"  a difference under about {statistics.median(halves):.3f} (the typical interval's "
                         "half-width) is within the noise of this held-out set")
    counts = [(run, median_counted(run)) for run in runs]
    counts = [(run, c) for run, c in counts if c is not None]
    if counts:
        lines.append("rho = P / (P + N) is measured over each run's own tokens; tokens per update (median): "
                     + ", ".join(f"{run.label} {c:.0f} tokens" for run, c in counts))
        if max(c for _, c in counts) > 1.5 * min(c for _, c in counts):
            lines.append("  so their shares are over different token sets (how many responses had reward spread, "
                         "and which tokens their bounds keep): compare them with that in mind")
    return lines


def _point(point: HeldoutPoint) -> str:
    text = f"{point.value:.3f}"
    if point.half_width is not None:
        text += f" [{point.value - point.half_width:.3f}, {point.value + point.half_width:.3f}]"
    return f"{text} at step {point.step}"
