"""`bapo-nemo check CONFIG --nodes N --gpus-per-node G`: validate a NeMo-RL GRPO config for a cluster shape
before submitting it (keys against the NeMo-RL the job runs: v0.7.0 by default, `--nemo-rl main` or
`installed`), estimate per-GPU memory and the step, and print it. The rules are plan/registry.py's (the
driver's pre-flight runs the same list, less the simulator's); `--list-rules` names them. Exit 1 on any error."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bapo_nemo.plan.registry import RuleContext, rule_lines, run_rules
from bapo_nemo.plan.rules.cluster_plan import ClusterPlan, plan_cluster
from bapo_nemo.plan.rules.config_io import ConfigLoadError, defaults_base, load_nemo_config
from bapo_nemo.plan.rules.findings import Finding, value
from bapo_nemo.plan.rules.memory import GB, GPU_CAPACITY_GB, MemoryEstimate
from bapo_nemo.plan.rules.models import UnknownModelError, resolve_model
from bapo_nemo.plan.rules.schema import DEFAULT_SCHEMA, SCHEMAS
from bapo_nemo.plan.simulation.check_run import CheckRun, search_statistics, step_cost
from bapo_nemo.plan.simulation.generation_print import (
    generation_json,
    print_generation,
    print_modes,
    seconds_json,
)
from bapo_nemo.plan.simulation.run_cost import cost_json, cost_line, run_cost
from bapo_nemo.plan.simulation.search_stats import (
    DEFAULT_PASS_RATE_BETA,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_RESPONSE_MEDIAN,
    DEFAULT_RESPONSE_SIGMA,
)
from bapo_nemo.plan.simulation.step_time import DEFAULT_FS_WRITE_GBPS_PER_NODE


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  bapo-nemo check configs/bapo_32b.yaml --nodes 8 --gpus-per-node 8\n"
        "  bapo-nemo check configs/bapo_7b.yaml --nodes 1 --gpus-per-node 8 --gpu h200-141gb --json\n"
        "  bapo-nemo check configs/bapo_32b.yaml --nodes 8 --gpus-per-node 8 "
        "policy.max_total_sequence_length=65536\n"
        "  bapo-nemo check configs/bapo_7b.yaml --nodes 1 --gpus-per-node 8 --response-lengths lengths.txt\n"
        "Exit 1 on any error. Embedded configs (configs/local_cpu.yaml) are for `bapo-nemo train`."
    )
    parser.add_argument(
        "--list-rules",
        action=_ListRules,
        help="print every rule, where it runs (check and/or the NeMo-RL driver's pre-flight), and exit",
    )
    _add_config_arguments(parser)
    _add_estimate_arguments(parser)


class _ListRules(argparse.Action):
    """Prints the registry and exits at once, like --help: no config or cluster shape needed."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print("\n".join(rule_lines()))
        parser.exit(0)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="NeMo-RL master config (YAML; `defaults:` inheritance is followed)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra-style overrides, e.g. cluster.num_nodes=8 ++a.b=1"
    )
    parser.add_argument("--nodes", type=_positive_int, required=True, help="nodes of the job (>= 1)")
    parser.add_argument("--gpus-per-node", type=_positive_int, required=True, help="GPUs per node (>= 1)")
    parser.add_argument(
        "--gpu", choices=sorted(GPU_CAPACITY_GB), default="h100-80gb", help="GPU model (default: %(default)s)"
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        help="local HF config.json of the model (default: policy.model_name if it is a local "
        "directory, else the built-in table)",
    )
    parser.add_argument(
        "--nemo-rl",
        choices=sorted(SCHEMAS),
        default=DEFAULT_SCHEMA,
        help="the NeMo-RL whose config keys are valid: a tested release (v0.7.0, the container's), its main "
        "of 2026-08-22, or the NeMo-RL installed here (default: %(default)s)",
    )
    parser.add_argument(
        "--no-path-checks", action="store_true", help="skip the existence checks of paths in the config"
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="working directory the job will run in, against which NeMo-RL resolves relative prompt files "
        "(default: the current one; slurm/bapo_32b.sbatch runs in the checkout, BAPO_REPO)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def _add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    # The response-length distribution of the bound-search statistics (bapo_nemo.plan.simulation.search_stats).
    parser.add_argument(
        "--response-length-median",
        type=float,
        default=DEFAULT_RESPONSE_MEDIAN,
        help="median response length in tokens (log-normal; default: long chain-of-thought math)",
    )
    parser.add_argument(
        "--response-length-sigma", type=float, default=DEFAULT_RESPONSE_SIGMA, help="log-normal shape"
    )
    parser.add_argument(
        "--response-lengths",
        default=None,
        metavar="FILE",
        help="measured response lengths, one per line (replaces the log-normal)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="typical prompt length in tokens"
    )
    parser.add_argument(
        "--pass-rate-beta",
        default=",".join(str(x) for x in DEFAULT_PASS_RATE_BETA),
        metavar="A,B",
        help="per-prompt pass rate ~ Beta(A, B) (decides the advantage signs)",
    )
    parser.add_argument(
        "--fs-write-gbps",
        type=float,
        default=DEFAULT_FS_WRITE_GBPS_PER_NODE,
        help="write bandwidth of each node to the checkpoint filesystem, GB/s (sizes the save time)",
    )
    parser.add_argument(
        "--mean-length-share",
        type=float,
        default=None,
        help="every sample (prompt + response) at this share of policy.max_total_sequence_length, instead of "
        "the response-length distribution above, for the step-time estimate (1 = every sample at full "
        "length, the longest step a config can produce)",
    )
    parser.add_argument(
        "--sbatch",
        default=None,
        help="batch script whose --signal lead is compared with the estimate (default: slurm/<config "
        "name>.sbatch, else slurm/bapo_32b.sbatch)",
    )


def _positive_int(text: str) -> int:
    """A cluster shape is counted in whole machines and GPUs: 0 or less is a typo in the flag itself."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def run_check(args) -> tuple[dict, list[Finding], MemoryEstimate | None, ClusterPlan | None]:
    """The config, every finding, the memory estimate and the cluster plan of one check."""
    ctx, findings = checked(args)
    return ctx.config, findings, ctx.run.memory, ctx.plan


def checked(args) -> tuple[RuleContext, list[Finding]]:
    """Loads the config, builds the cluster plan and the model shape (their findings first), then runs
    every registered rule."""
    if args.nemo_rl == "installed" and importlib.util.find_spec("nemo_rl") is None:
        raise ConfigLoadError(
            "--nemo-rl installed: no NeMo-RL is importable here; check against a tested tree with "
            "--nemo-rl v0.7.0 or --nemo-rl main, or run the check inside the NeMo-RL image"
        )
    config = load_nemo_config(args.config, args.overrides)
    model, findings = None, []
    note = defaults_base(args.config)[1]
    if note is not None:
        findings.append(Finding("warning", "defaults", note))
    try:
        model = resolve_model(str(value(config, "policy.model_name")), args.hf_config)
    except UnknownModelError as exc:
        findings.append(Finding("error", "policy.model_name", str(exc)))
    except (OSError, KeyError, json.JSONDecodeError) as exc:
        findings.append(Finding("error", "--hf-config", f"cannot read the model's config.json: {exc}"))
    changed = {item.split("=", 1)[0].lstrip("+~") for item in args.overrides}
    plan, layout_findings = plan_cluster(config, args.nodes, args.gpus_per_node, model, changed)
    workdir = Path(args.workdir) if args.workdir is not None else Path.cwd()
    run = CheckRun(args, config, plan, model)
    ctx = RuleContext(config, plan, model, workdir, args.nemo_rl, not args.no_path_checks, run)
    return ctx, layout_findings + findings + run_rules(ctx)


def lengths_label(args) -> str:
    if args.mean_length_share is not None:
        return f"every sample at {args.mean_length_share:g} x max_total_sequence_length"
    if args.response_lengths:
        return "measured lengths from " + args.response_lengths
    return f"log-normal median {args.response_length_median:g}, sigma {args.response_length_sigma:g}"


def _result_json(findings, plan, mem, stats, cost, step, comparison, whole_run) -> dict:
    """What `--json` prints."""
    errors = [x for x in findings if x.level == "error"]
    step_time = step.estimate if step is not None else None
    return {
        "ok": not errors,
        "findings": [x.__dict__ for x in findings],
        "parallel": plan.parallel.__dict__ if plan else None,
        "memory_gb": None
        if mem is None
        else {
            "training": {k: v / GB for k, v in mem.terms.items()},
            "training_peak": mem.training_peak / GB,
            "generation": {k: v / GB for k, v in mem.generation_terms.items()},
            "generation_peak": mem.generation_peak / GB,
            "capacity": mem.capacity / GB,
            "margin": mem.margin / GB,
            "fits": mem.fits,
        },
        "bound_search": None if stats is None else stats.__dict__,
        "step_granularity_cost": None if cost is None else cost.__dict__,
        "step_time_s": None if step_time is None else seconds_json(step_time),
        "generation": None if step is None else generation_json(step, comparison),
        "run_cost": None if whole_run is None else cost_json(whole_run),
    }


def _memory_table(mem: MemoryEstimate) -> Table:
    table = Table(title="estimated memory per GPU (GB)", show_lines=False)
    table.add_column("phase / term")
    table.add_column("GB", justify="right")
    for name, b in mem.terms.items():
        table.add_row(f"train: {name}", f"{b / GB:.1f}")
    table.add_row(
        "[bold]training peak[/] (+10% fragmentation, +4 GB runtime)",
        f"[bold]{mem.training_peak / GB:.1f}[/]",
    )
    for name, b in mem.generation_terms.items():
        table.add_row(f"generation: {name}", f"{b / GB:.1f}")
    if mem.generation_terms:
        table.add_row(
            "[bold]generation peak[/] (+4 GB runtime)", f"[bold]{mem.generation_peak / GB:.1f}[/]"
        )
    verdict = "[green]FITS[/]" if mem.fits else "[red]DOES NOT FIT[/]"
    table.add_row(f"{verdict} in {mem.capacity / GB:.0f} GB", f"margin {mem.margin / GB:.1f}")
    return table


def _print_estimates(console: Console, args, config: dict, stats, cost, step, comparison) -> None:
    """The bound search, granularity step's cost, the simulated generation, the modes side by side, the
    step time and the signal lead it asks for."""
    step_time = step.estimate if step is not None else None
    if stats is not None:
        console.print(
            f"BAPO bound search ({value(config, 'loss_fn.bapo.granularity') or 'microbatch'}): "
            f"~{stats.responses_median:.0f} responses per search (mean {stats.responses_mean:.1f}, p10-p90 "
            f"{stats.responses_p10:.0f}-{stats.responses_p90:.0f}) from {stats.groups_mean:.1f} prompt groups; "
            f"{stats.one_sided:.1%} of searches see one advantage sign only"
        )
    if cost is not None:
        console.print(
            f"granularity step: {cost.extra_passes} extra no-grad log-prob pass(es) per rollout batch, "
            f"{cost.extra_pflops:.0f} PFLOPs = {cost.share_of_training:.1%} of the training compute "
            f"(<= {cost.share_of_step:.1%} of the step with generation); the LR scheduler ticks per optimizer step"
        )
    if step is not None:
        print_generation(console, step, config, lengths_label(args))
    if comparison is not None:
        print_modes(console, comparison)
    if step_time is not None:
        mode = " with its partial rollouts" if step.configured else " with async GRPO" if step.own_async else ""
        waiting = "waiting for generation and the weight update" if step.own_async else "generation"
        console.print(
            f"estimated step time (this config{mode}; a planning figure): {step_time.step_s:.0f}s = {waiting} "
            f"{step_time.generation_s:.0f}s + log-prob "
            f"passes {step_time.logprob_s:.0f}s + training {step_time.train_s:.0f}s; validation adds "
            f"{step_time.validation_s:.0f}s; checkpoint save {step_time.save_s:.0f}s at "
            f"{args.fs_write_gbps:g} GB/s per node"
        )
        console.print(
            f"recommended signal lead: {step_time.recommended_lead_s}s (step + validation + save + "
            f"{step_time.margin_s:.0f}s margin, rounded up to a minute): "
            f"sbatch --signal=B:USR1@{step_time.recommended_lead_s}"
        )


def main(args) -> int:
    console = Console(width=130)
    try:
        ctx, findings = checked(args)
    except ConfigLoadError as exc:
        console.print(f"[bold red]error[/]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 1
    config, plan, run = ctx.config, ctx.plan, ctx.run
    errors = [x for x in findings if x.level == "error"]
    mem, step, comparison = run.memory, run.step, run.comparison  # kept: the rules computed them
    stats = search_statistics(args, config, plan)[0]  # kept: the same simulation the rule ran
    cost = step_cost(args, config, plan, ctx.model)
    step_time = step.estimate if step is not None else None
    whole_run = None if step_time is None else run_cost(config, step_time, args.nodes * args.gpus_per_node)
    if args.json:
        print(json.dumps(_result_json(findings, plan, mem, stats, cost, step, comparison, whole_run), indent=2))
        return 1 if errors else 0
    console.print(f"[bold]{args.config}[/] on {args.nodes} x {args.gpus_per_node} {args.gpu}")
    if plan is not None:
        p = plan.parallel
        console.print(
            f"backend {plan.backend}: {plan.train_gpus} training GPUs = TP {p.tp} x PP {p.pp} x CP {p.cp} "
            f"x DP {p.dp}; sequence parallel {p.sequence_parallel}; generation "
            f"{'colocated' if plan.generation.colocated else f'on {plan.generation_gpus} GPUs'}"
        )
    if mem is not None:
        console.print(_memory_table(mem))
    _print_estimates(console, args, config, stats, cost, step, comparison)
    if whole_run is not None:
        console.print(cost_line(whole_run))
    if findings:
        table = Table(title="findings")
        table.add_column("level")
        table.add_column("key")
        table.add_column("problem and fix", overflow="fold")
        for x in findings:
            table.add_row("[red]error[/]" if x.level == "error" else "[yellow]warning[/]", x.key, x.message)
        console.print(table)
    console.print(
        f"[bold]{'FAILED' if errors else 'OK'}[/]: {len(errors)} error(s), {len(findings) - len(errors)} warning(s)"
    )
    return 1 if errors else 0
