"""`bapo-nemo check CONFIG --nodes N --gpus-per-node G`: validate a NeMo-RL GRPO config for a cluster shape
before submitting it (keys against the NeMo-RL the job runs: v0.7.0 by default, `--nemo-rl main` or
`installed`), and estimate per-GPU memory. Exit 1 on any error."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bapo_nemo.plan.bound_search_checks import search_statistics_rules, step_granularity_cost_for
from bapo_nemo.plan.checks import check_config
from bapo_nemo.plan.cluster_plan import plan_cluster
from bapo_nemo.plan.config_io import ConfigLoadError, defaults_base, load_nemo_config
from bapo_nemo.plan.findings import Finding, value
from bapo_nemo.plan.generation_print import generation_json, print_generation, print_modes, seconds_json
from bapo_nemo.plan.gpus import fp8_rules
from bapo_nemo.plan.memory import GB, GPU_CAPACITY_GB, MemoryEstimate, estimate
from bapo_nemo.plan.mode_compare import ModeComparison, async_warnings, compare_modes
from bapo_nemo.plan.models import UnknownModelError, resolve_model
from bapo_nemo.plan.run_cost import cost_json, cost_line, run_cost
from bapo_nemo.plan.schema import DEFAULT_SCHEMA, SCHEMAS
from bapo_nemo.plan.search_stats import (
    DEFAULT_PASS_RATE_BETA,
    DEFAULT_PROMPT_TOKENS,
    DEFAULT_RESPONSE_MEDIAN,
    DEFAULT_RESPONSE_SIGMA,
    LengthModel,
    LengthModelError,
    read_lengths,
)
from bapo_nemo.plan.signal_lead import lead_warning, shipped_sbatch, signal_line
from bapo_nemo.plan.step_plan import StepPlan, length_model, plan_step
from bapo_nemo.plan.step_time import DEFAULT_FS_WRITE_GBPS_PER_NODE


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
    # The response-length distribution of the bound-search statistics (bapo_nemo.plan.search_stats).
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


def search_statistics(args, config: dict, plan):
    """Responses per BAPO bound search for this config (see bapo_nemo.plan.search_stats)."""
    options = length_options(args)
    if isinstance(options, Finding):
        return None, [options]
    lengths, prompt, beta = options
    return search_statistics_rules(config, plan, lengths, prompt, beta)


def step_cost(args, config: dict, plan):
    """The compute granularity=step adds (None if the model shape or an option is unusable: run_check
    reports those)."""
    options = length_options(args)
    try:
        model = resolve_model(str(value(config, "policy.model_name")), args.hf_config)
    except (UnknownModelError, OSError, KeyError, json.JSONDecodeError):
        return None
    if isinstance(options, Finding):
        return None
    lengths, prompt, _ = options
    return step_granularity_cost_for(config, plan, model, lengths, prompt)


def _positive_int(text: str) -> int:
    """A cluster shape is counted in whole machines and GPUs: 0 or less is a typo in the flag itself."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def step_time_check(args, config: dict, plan) -> tuple[StepPlan | None, list[Finding]]:
    """The step with and without partial rollouts, the save, and the signal lead the config's own choice
    asks for against the batch script's."""
    if plan is None:
        return None, []
    try:
        model = resolve_model(str(value(config, "policy.model_name")), args.hf_config)
    except (UnknownModelError, OSError, KeyError, json.JSONDecodeError):
        return None, []  # run_check reported it
    if args.fs_write_gbps <= 0:
        return None, [Finding("error", "--fs-write-gbps", "must be a positive bandwidth in GB/s, e.g. 1.0")]
    if args.mean_length_share is not None and not 0 < args.mean_length_share <= 1:
        return None, [Finding("error", "--mean-length-share", "must be in (0, 1], e.g. 0.5")]
    options = length_options(args)
    if isinstance(options, Finding):
        return None, []  # run_check reported it
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


def run_check(args) -> tuple[dict, list[Finding], MemoryEstimate | None, object]:
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
    findings = layout_findings + findings
    findings += check_config(
        config, plan, model, check_paths=not args.no_path_checks, workdir=args.workdir, nemo_rl=args.nemo_rl
    )
    findings += fp8_rules(config, args.gpu)
    mem = None
    if plan is not None and model is not None:
        if plan.backend != "megatron":
            findings.append(
                Finding(
                    "warning",
                    "policy.megatron_cfg.enabled",
                    "the memory model covers the Megatron backend; the DTensor estimate is indicative",
                )
            )
        mem = estimate(model, plan.parallel, plan.training, plan.generation, args.gpu)
        if not mem.fits:
            findings.append(
                Finding(
                    "error",
                    "policy.megatron_cfg",
                    f"estimated peak {mem.peak / GB:.1f} GB exceeds {mem.capacity / GB:.0f} GB per GPU: "
                    "raise TP/CP/PP, turn on activation_checkpointing, or lower "
                    "gpu_memory_utilization / train_mb_tokens",
                )
            )
    findings += search_statistics(args, config, plan)[1]
    return config, findings, mem, plan


def modes_check(args, config: dict, plan, step: StepPlan | None) -> tuple[ModeComparison | None, list[Finding]]:
    """Sync, partial rollouts and async GRPO side by side on this cluster (plan/mode_compare.py)."""
    if step is None or plan is None:
        return None, []
    try:
        model = resolve_model(str(value(config, "policy.model_name")), args.hf_config)
    except (UnknownModelError, OSError, KeyError, json.JSONDecodeError):
        return None, []  # run_check reported it
    comparison = compare_modes(config, plan, step, args.nodes, args.gpus_per_node, model, args.gpu, args.prompt_tokens)
    return comparison, async_warnings(comparison)


def lengths_label(args) -> str:
    if args.mean_length_share is not None:
        return f"every sample at {args.mean_length_share:g} x max_total_sequence_length"
    if args.response_lengths:
        return "measured lengths from " + args.response_lengths
    return f"log-normal median {args.response_length_median:g}, sigma {args.response_length_sigma:g}"


def main(args) -> int:
    console = Console(width=130)
    try:
        config, findings, mem, plan = run_check(args)
    except ConfigLoadError as exc:
        console.print(f"[bold red]error[/]: {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 1
    step, step_findings = step_time_check(args, config, plan)
    comparison, mode_findings = modes_check(args, config, plan, step)
    findings = findings + step_findings + mode_findings
    errors = [x for x in findings if x.level == "error"]
    stats = search_statistics(args, config, plan)[0]  # kept: the same simulation run_check made
    cost = step_cost(args, config, plan)
    step_time = step.estimate if step is not None else None
    run = None if step_time is None else run_cost(config, step_time, args.nodes * args.gpus_per_node)
    if args.json:
        print(
            json.dumps(
                {
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
                    "run_cost": None if run is None else cost_json(run),
                },
                indent=2,
            )
        )
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
        console.print(table)
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
    if run is not None:
        console.print(cost_line(run))
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
