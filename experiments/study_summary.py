"""The numbers of a finished study, read from its MLflow stores: which runs completed, per-run statistics,
their mean +- std over seeds per cell, and paired differences against the study's baseline method.

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

import json
import math
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from experiments.grid import Budget, RunSpec, Study, expand, get_study
from experiments.run import DEFAULT_ROOT, DONE, experiment_name, run_dir, tracking_uri

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


def line_label(labels: dict[str, str], row_axis: str | None) -> str:
    return "/".join(v for k, v in labels.items() if k != row_axis) or "all"
