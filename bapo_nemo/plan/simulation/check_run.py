"""What `bapo-nemo check` simulates for one config beyond the config rules, from the command's options
(response lengths, prompt length, GPU, batch script): the bound-search statistics, the step time and its
signal lead, sync/partial/async side by side, and the memory estimate. `CheckRun` keeps each result so the
rules (plan/registry.py) and the printing (check_cli.py) share one computation. `args` is the parsed
command line (check_cli.configure_parser); this module never imports the CLI."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bapo_nemo.plan.rules.cluster_plan import ClusterPlan
from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.memory import MemoryEstimate, estimate
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.rules.signal_lead import lead_warning, shipped_sbatch, signal_line
from bapo_nemo.plan.simulation.bound_search_checks import search_statistics_rules, step_granularity_cost_for
from bapo_nemo.plan.simulation.mode_compare import ModeComparison, async_warnings, compare_modes
from bapo_nemo.plan.simulation.search_stats import LengthModel, LengthModelError, SearchStats, read_lengths
from bapo_nemo.plan.simulation.step_cost import StepCost
from bapo_nemo.plan.simulation.step_plan import StepPlan, length_model, plan_step


class CheckRun:
    """One `bapo-nemo check`: its options, and each simulation's result once computed (`once`)."""

    def __init__(self, args, config: dict, plan: ClusterPlan | None, model: ModelShape | None):
        self.args, self.config, self.plan, self.model = args, config, plan, model
        self._results: dict[Callable, Any] = {}

    def once(self, function: Callable, *arguments) -> Any:
        """`function(*arguments)`, computed on the first call only (the arguments of one run never change)."""
        if function not in self._results:
            self._results[function] = function(*arguments)
        return self._results[function]

    @property
    def memory(self) -> MemoryEstimate | None:
        if self.plan is None or self.model is None:
            return None
        p = self.plan
        return self.once(estimate, self.model, p.parallel, p.training, p.generation, self.args.gpu)

    @property
    def step(self) -> StepPlan | None:
        return self.once(step_time_rules, self.args, self.config, self.plan, self.model)[0]

    @property
    def comparison(self) -> ModeComparison | None:
        return self.once(mode_rules, self.args, self.config, self.plan, self.model, self.step)[0]


def length_options(args) -> tuple[LengthModel, int, tuple[float, float]] | Finding:
    """The response-length model, prompt length and pass-rate prior from the command line, or the
    error finding that names the bad option."""
    try:
        a, b = (float(x) for x in str(args.pass_rate_beta).split(","))
        if a <= 0 or b <= 0:
            raise ValueError
    except ValueError:
        return Finding("error", "--pass-rate-beta", "expects two positive numbers A,B, e.g. 1,1")
    if not args.response_length_median > 0 or not args.response_length_sigma >= 0:
        return Finding(
            "error", "--response-length-median", "the median must be > 0 and the sigma >= 0 (tokens, log-normal)"
        )
    try:
        empirical = read_lengths(args.response_lengths) if args.response_lengths else None
    except (OSError, LengthModelError) as exc:
        return Finding("error", "--response-lengths", str(exc))
    # max_tokens is a placeholder: the checks cap lengths from the config's generation settings.
    lengths = LengthModel(1, args.response_length_median, args.response_length_sigma, empirical)
    return lengths, args.prompt_tokens, (a, b)


def search_statistics(args, config: dict, plan: ClusterPlan | None) -> tuple[SearchStats | None, list[Finding]]:
    """Responses per BAPO bound search for this config (search_stats.py), and the warning when too few."""
    options = length_options(args)
    if isinstance(options, Finding):
        return None, [options]
    lengths, prompt, beta = options
    return search_statistics_rules(config, plan, lengths, prompt, beta)


def step_cost(args, config: dict, plan: ClusterPlan | None, model: ModelShape | None) -> StepCost | None:
    """The compute granularity=step adds (None if the model shape or an option is unusable: the rules
    report those)."""
    options = length_options(args)
    if model is None or isinstance(options, Finding):
        return None
    lengths, prompt, _ = options
    return step_granularity_cost_for(config, plan, model, lengths, prompt)


def step_time_rules(
    args, config: dict, plan: ClusterPlan | None, model: ModelShape | None
) -> tuple[StepPlan | None, list[Finding]]:
    """The step with and without partial rollouts, the save, and the signal lead the config's own choice
    asks for against the batch script's."""
    if plan is None or model is None:
        return None, []  # the model's own finding says why
    if args.fs_write_gbps <= 0:
        return None, [Finding("error", "--fs-write-gbps", "must be a positive bandwidth in GB/s, e.g. 1.0")]
    if args.mean_length_share is not None and not 0 < args.mean_length_share <= 1:
        return None, [Finding("error", "--mean-length-share", "must be in (0, 1], e.g. 0.5")]
    options = length_options(args)
    if isinstance(options, Finding):
        return None, []  # the search-statistics rule reported it
    lengths = length_model(options[0], config, args.prompt_tokens, args.mean_length_share)
    step, findings = plan_step(
        config, plan, model, args.gpu, args.nodes, lengths, args.prompt_tokens, args.fs_write_gbps
    )
    if step is None:
        return None, findings
    lead = step.estimate.recommended_lead_s
    sbatch = Path(args.sbatch) if args.sbatch else shipped_sbatch(args.config)
    if sbatch is None or not sbatch.is_file():
        if args.sbatch:
            return step, findings + [Finding("error", "--sbatch", f"{args.sbatch} not found: pass an existing batch script")]
        return step, findings
    signal = signal_line(sbatch)
    if signal is None:
        return step, findings + [
            Finding(
                "warning",
                "#SBATCH --signal",
                f"{sbatch} has no `#SBATCH --signal=B:USR1@SECONDS` line: add one with at least {lead} seconds",
            )
        ]
    message = lead_warning(signal, lead)
    return step, findings + ([] if message is None else [Finding("warning", "#SBATCH --signal", message)])


def mode_rules(
    args, config: dict, plan: ClusterPlan | None, model: ModelShape | None, step: StepPlan | None
) -> tuple[ModeComparison | None, list[Finding]]:
    """Sync, partial rollouts and async GRPO side by side on this cluster (mode_compare.py), and the
    warnings about async GRPO that comparison finds."""
    if step is None or plan is None or model is None:
        return None, []
    comparison = compare_modes(config, plan, step, args.nodes, args.gpus_per_node, model, args.gpu, args.prompt_tokens)
    return comparison, async_warnings(comparison)
