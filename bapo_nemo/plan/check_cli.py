"""`bapo-nemo check CONFIG --nodes N --gpus-per-node G`: validate a NeMo-RL v0.7.0 GRPO config for a
cluster shape before submitting it, and estimate per-GPU memory. Exit 1 on any error."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bapo_nemo.plan.checks import Finding, check_config, plan_cluster, value
from bapo_nemo.plan.config_io import ConfigLoadError, load_nemo_config
from bapo_nemo.plan.memory import GB, GPU_CAPACITY_GB, MemoryEstimate, estimate
from bapo_nemo.plan.models import UnknownModelError, resolve_model
from bapo_nemo.plan.signal_lead import lead_warning, shipped_sbatch, signal_line
from bapo_nemo.plan.step_time import (
    DEFAULT_FS_WRITE_GBPS_PER_NODE,
    StepTimeEstimate,
    estimate_step_time,
    shape_from_config,
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="NeMo-RL master config (YAML; `defaults:` inheritance is followed)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra-style overrides, e.g. cluster.num_nodes=8 ++a.b=1"
    )
    parser.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    parser.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    parser.add_argument(
        "--gpu", choices=sorted(GPU_CAPACITY_GB), default="h100-80gb", help="GPU model (memory)"
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        help="local HF config.json of the model (default: policy.model_name if it is a local "
        "directory, else the built-in table)",
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
    parser.add_argument(
        "--fs-write-gbps",
        type=float,
        default=DEFAULT_FS_WRITE_GBPS_PER_NODE,
        help="write bandwidth of each node to the checkpoint filesystem, GB/s (sizes the save time)",
    )
    parser.add_argument(
        "--mean-length-share",
        type=float,
        default=1.0,
        help="mean sample length (prompt + response) as a share of policy.max_total_sequence_length for "
        "the step-time estimate (default 1: every sample at full length, the longest step)",
    )
    parser.add_argument(
        "--sbatch",
        default=None,
        help="batch script whose --signal lead is compared with the estimate (default: slurm/<config "
        "name>.sbatch, else slurm/bapo_32b.sbatch)",
    )


def step_time_check(args, config: dict, plan) -> tuple[StepTimeEstimate | None, list[Finding]]:
    """Step and save time, and the signal lead they ask for against the batch script's."""
    if plan is None:
        return None, []
    try:
        model = resolve_model(str(value(config, "policy.model_name")), args.hf_config)
    except (UnknownModelError, OSError, KeyError, json.JSONDecodeError):
        return None, []  # run_check reported it
    if args.fs_write_gbps <= 0:
        return None, [Finding("error", "--fs-write-gbps", "must be a positive bandwidth in GB/s, e.g. 1.0")]
    if not 0 < args.mean_length_share <= 1:
        return None, [Finding("error", "--mean-length-share", "must be in (0, 1], e.g. 0.5")]
    shape = shape_from_config(config, plan.train_gpus, plan.generation_gpus, args.mean_length_share)
    est = estimate_step_time(
        model, shape, args.gpu, GPU_CAPACITY_GB[args.gpu] * GB, args.nodes, args.fs_write_gbps
    )
    sbatch = Path(args.sbatch) if args.sbatch else shipped_sbatch(args.config)
    if sbatch is None or not sbatch.is_file():
        if args.sbatch:
            missing = f"{args.sbatch} not found: pass an existing batch script"
            return est, [Finding("error", "--sbatch", missing)]
        return est, []
    signal = signal_line(sbatch)
    if signal is None:
        return est, [
            Finding(
                "warning",
                "#SBATCH --signal",
                f"{sbatch} has no `#SBATCH --signal=B:USR1@SECONDS` line: add one with at least "
                f"{est.recommended_lead_s} seconds",
            )
        ]
    message = lead_warning(signal, est.recommended_lead_s)
    return est, [] if message is None else [Finding("warning", "#SBATCH --signal", message)]


def run_check(args) -> tuple[dict, list[Finding], MemoryEstimate | None, object]:
    config = load_nemo_config(args.config, args.overrides)
    plan, findings = plan_cluster(config, args.nodes, args.gpus_per_node)
    model = None
    try:
        model = resolve_model(str(value(config, "policy.model_name")), args.hf_config)
    except UnknownModelError as exc:
        findings.append(Finding("error", "policy.model_name", str(exc)))
    except (OSError, KeyError, json.JSONDecodeError) as exc:
        findings.append(Finding("error", "--hf-config", f"cannot read the model's config.json: {exc}"))
    findings += check_config(config, plan, model, check_paths=not args.no_path_checks, workdir=args.workdir)
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
    return config, findings, mem, plan


def main(args) -> int:
    console = Console(width=130)
    try:
        config, findings, mem, plan = run_check(args)
    except ConfigLoadError as exc:
        console.print(f"[bold red]error[/]: {exc}")
        return 1
    step_time, lead_findings = step_time_check(args, config, plan)
    findings = findings + lead_findings
    errors = [x for x in findings if x.level == "error"]
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
                    "step_time_s": None
                    if step_time is None
                    else {
                        "generation": step_time.generation_s,
                        "logprob_passes": step_time.logprob_s,
                        "training": step_time.train_s,
                        "step": step_time.step_s,
                        "validation": step_time.validation_s,
                        "save": step_time.save_s,
                        "margin": step_time.margin_s,
                        "recommended_signal_lead": step_time.recommended_lead_s,
                    },
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
    if step_time is not None:
        console.print(
            f"estimated step time (mean sample at {args.mean_length_share:g} x max_total_sequence_length; "
            "a planning figure): "
            f"{step_time.step_s:.0f}s = generation {step_time.generation_s:.0f}s + log-prob passes "
            f"{step_time.logprob_s:.0f}s + training {step_time.train_s:.0f}s; validation adds "
            f"{step_time.validation_s:.0f}s; checkpoint save {step_time.save_s:.0f}s at "
            f"{args.fs_write_gbps:g} GB/s per node"
        )
        console.print(
            f"recommended signal lead: {step_time.recommended_lead_s}s (step + validation + save + "
            f"{step_time.margin_s:.0f}s margin, rounded up to a minute): "
            f"sbatch --signal=B:USR1@{step_time.recommended_lead_s}"
        )
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
