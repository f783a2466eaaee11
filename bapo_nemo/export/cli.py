"""`bapo-nemo export CHECKPOINT --out DIR [--fp8] [--register-model NAME] [--force]`.

CHECKPOINT is an embedded ``step_<N>`` directory (or the training ``output_dir``: its newest complete
checkpoint is used) or a NeMo-RL ``checkpoint_dir/step_<N>`` (Megatron; runs inside the NeMo-RL
container). Every export ends with a parity check and prints the max |difference| of per-token log-probs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bapo_nemo.export.checkpoint import ExportError, resolve_checkpoint
from bapo_nemo.tracking.redact import REDACTED, redact_text


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  bapo-nemo export runs/local_cpu --out exports/local_cpu\n"
        "  bapo-nemo export runs/local_cpu/checkpoints/step_40 --out exports/step_40_fp8 --fp8\n"
        "  bapo-nemo export runs/local_cpu --out exports/local_cpu --register-model bapo-tiny --force\n"
        "  bapo-nemo export results/bapo_7b/step_100 --out exports/bapo_7b   (NeMo-RL, in the container)"
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="embedded step_<N> dir or training output_dir; or a NeMo-RL checkpoint_dir/step_<N>")
    parser.add_argument("--out", required=True, help="directory to write the Hugging Face model to")
    parser.add_argument("--fp8", action="store_true",
                        help="post-training FP8 (e4m3) quantisation with NVIDIA ModelOpt for serving (embedded only)")
    parser.add_argument("--register-model", metavar="NAME",
                        help="log the export to the source MLflow run and register it as a version of NAME")
    parser.add_argument("--tracking-uri", help="MLflow store for --register-model (default: the checkpoint's own)")
    parser.add_argument("--force", action="store_true",
                        help="replace --out if it is a previous export (never a run or other files)")
    parser.add_argument("--parity-prompts", metavar="FILE", type=Path,
                        help="held-out prompts for the parity check, one per line (default: built-in ones)")


def main(args: argparse.Namespace) -> int:
    try:
        ref = resolve_checkpoint(args.checkpoint)
        prompts = None
        if args.parity_prompts is not None:
            if not args.parity_prompts.is_file():
                raise ExportError(f"--parity-prompts {args.parity_prompts} does not exist")
            prompts = [line for line in args.parity_prompts.read_text().splitlines() if line.strip()]
            if not prompts:
                raise ExportError(f"--parity-prompts {args.parity_prompts} holds no prompts")
        from bapo_nemo.export.hf import check_output_dir

        check_output_dir(Path(args.out).resolve(), args.force, ref.path)  # before the work, not after it
        if args.register_model and ref.kind == "embedded":  # fail before the work, not after it
            _check_registrable(ref.path, args.tracking_uri)
        if args.fp8 and ref.kind == "embedded":
            from bapo_nemo.export.fp8 import import_modelopt

            import_modelopt()  # a missing ModelOpt is said before anything is loaded
        print(f"exporting {ref.kind} checkpoint {ref.path} -> {args.out}")
        if ref.kind == "nemo_rl":
            if args.fp8:
                raise ExportError("--fp8 is for embedded checkpoints: export the NeMo-RL checkpoint without --fp8, "
                                  "then quantise the HF model with ModelOpt's examples/llm_ptq/hf_ptq.py on a GPU")
            from bapo_nemo.export import megatron_python as mp

            python = None if mp.in_rerun() else mp.megatron_python()
            if python is not None:  # the image's default venv has no Megatron-Bridge
                return mp.rerun_with(python, mp.export_cli_args(args))
            from bapo_nemo.export.megatron import export_megatron

            result = export_megatron(ref, args.out, force=args.force)
        else:
            result = _export_embedded(args, ref, prompts)
        if args.register_model:
            from bapo_nemo.export.registry import register_export

            uri = args.tracking_uri or _checkpoint_tracking_uri(ref.path)
            version = register_export(result, args.register_model, uri,
                                      artifact_path="hf_export_fp8" if args.fp8 else "hf_export")
            print(f"registered model {args.register_model!r} version {version.version} (run {result.run_id})")
        print(f"wrote {result.out_dir}")
        return 0
    except (ExportError, ValueError, FileNotFoundError) as exc:
        print(f"bapo-nemo export: error: {redact_text(str(exc))}", file=sys.stderr)
        return 2


def _export_embedded(args: argparse.Namespace, ref, prompts):
    """HF (or FP8) export of an embedded checkpoint. Given a run directory whose newest checkpoint the still
    running trainer prunes while it is read, the export moves on to the newest one (and says so)."""
    from bapo_nemo.export.hf import CheckpointVanished

    if args.fp8:
        from bapo_nemo.export.fp8 import export_fp8 as export
    else:
        from bapo_nemo.export.hf import export_embedded as export
    for attempt in range(3):
        try:
            return export(ref, args.out, force=args.force, parity_prompts=prompts)
        except CheckpointVanished:
            if ref.path == Path(args.checkpoint).resolve() or attempt == 2:  # the user named this step
                raise
            newer = resolve_checkpoint(args.checkpoint)
            print(f"note: {ref.path.name} was deleted by the training run's checkpoint pruning while it was read; "
                  f"exporting {newer.path.name}, now the newest")
            ref = newer


def _check_registrable(step_dir: Path, tracking_uri: str | None) -> None:
    info_file = step_dir / "training_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    if not info.get("mlflow_run_id"):
        raise ExportError(f"{info_file} records no MLflow run id, so the export cannot be attached to its run "
                          "for --register-model; export without it, or export a tracked checkpoint")
    recorded = info.get("mlflow_tracking_uri")
    if not tracking_uri and (not recorded or REDACTED in recorded):
        why = "no mlflow_tracking_uri" if not recorded else "the tracking URI with its password redacted"
        raise ExportError(f"{info_file} records {why}: pass --tracking-uri")


def _checkpoint_tracking_uri(step_dir: Path) -> str:
    info_file = step_dir / "training_info.json"
    uri = json.loads(info_file.read_text()).get("mlflow_tracking_uri") if info_file.is_file() else None
    if not uri:
        raise ExportError(f"{info_file} records no mlflow_tracking_uri: pass --tracking-uri")
    return uri
