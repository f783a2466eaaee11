"""`bapo-nemo train CONFIG.yaml [key.sub=value ...]`: the embedded trainer from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bapo_nemo.embedded.config.run_config import RunConfigError, load_config
from bapo_nemo.embedded.run.compare import CompareError, tracking_overrides
from bapo_nemo.tracking.redact import redact_text


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train a tiny Qwen2 with GRPO + BAPO on the bundled arithmetic tasks, on one machine (CPU by "
        "default): supervised warm-up, partial rollouts, held-out avg@k/pass@k, MLflow tracking, "
        "checkpoints. Ctrl-C, SIGTERM or SIGHUP stop after the current step with a checkpoint and exit 130, 143 "
        "or 129 (128 + the signal); SIGUSR1, the requeue request of a batch job, checkpoints and exits 0."
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  bapo-nemo train configs/local_cpu.yaml\n"
        "  bapo-nemo train configs/local_cpu.yaml --output-dir runs/a --resume\n"
        "  bapo-nemo train configs/local_cpu.yaml loss_fn.bapo.enabled=false loss_fn.bapo.c_low_min=0.8 \\\n"
        "      --output-dir runs/fixed_clip --compare-with runs/local_cpu   # a fixed-clip baseline beside a run\n"
        "  bapo-nemo train configs/local_cpu.yaml train.updates_per_batch=4 partial_rollouts.token_budget=16"
    )
    parser.add_argument("config", help="run config YAML (e.g. configs/local_cpu.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="override any config key (value parsed as YAML); unknown keys are an error",
    )
    parser.add_argument(
        "--output-dir",
        default=None,
        help="where checkpoints, MLflow store, metrics and hf_final go (default: runs/<config file name>, "
        "e.g. runs/local_cpu)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="resume from the newest COMPLETE checkpoint in --output-dir if there is one, "
        "else start fresh (so a requeued job can always pass it)",
    )
    parser.add_argument(
        "--compare-with",
        metavar="RUN_DIR",
        help="track this run beside the run in RUN_DIR (another run's --output-dir): in its MLflow store and "
        "experiment, so mlflow ui and bapo-nemo report show both; its warm-up is reused when the warm-up's "
        "inputs are the same",
    )
    parser.add_argument("--seed", type=int, default=None, help="override grpo.seed")
    parser.add_argument("--max-steps", type=int, default=None, help="override grpo.max_num_steps (RL steps)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (batch jobs)")
    parser.add_argument("--json", action="store_true",
                        help="end with the run's summary as JSON on stdout instead of the summary in words")


def main(args: argparse.Namespace) -> int:
    """Exit 0 when the run finished (or stopped on the requeue request, SIGUSR1); 128 + the signal's number
    when a signal stopped it after a checkpoint (130 for Ctrl-C, 143 for SIGTERM); 2 on a user error (one
    line on stderr naming the key or file and the fix)."""
    _warnings_as_lines()  # first: reading the config may warn (an old key name)
    overrides = list(args.overrides)
    if args.seed is not None:
        overrides.append(f"grpo.seed={args.seed}")
    if args.max_steps is not None:
        overrides.append(f"grpo.max_num_steps={args.max_steps}")
    if args.no_progress:
        overrides.append("runtime.progress=false")
    output_dir = args.output_dir or str(Path("runs") / Path(args.config).stem)
    compared = None
    try:
        config = load_config(args.config, overrides)
        if args.compare_with:
            compared = _compared(args.compare_with, output_dir)
            overrides += tracking_overrides(compared, config.logger.mlflow.tracking_uri, overrides)
            config = load_config(args.config, overrides)
    except (RunConfigError, CompareError) as exc:
        print(f"error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    # the CPU settings: bf16 autocast is a GPU setting (slower than fp32 on most CPUs, and less exact)
    cpu_settings = "runtime.device=cpu" + " policy.precision=float32" * (config.policy.precision != "float32")
    if config.runtime.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            missing_gpu = (f"runtime.device=cuda but torch sees no CUDA GPU (torch {torch.__version__}, CUDA build "
                           f"{torch.version.cuda or 'none'}): run on a GPU machine or add {cpu_settings}")
            print(f"error: {_with_the_other_startup_problems(missing_gpu, config)}", file=sys.stderr)
            return 2
    elif config.policy.precision == "bfloat16":
        print("note: policy.precision=bfloat16 on CPU: every forward runs under bf16 autocast, slower than "
              "float32 on most CPUs and less exact; add policy.precision=float32 for the CPU setting",
              file=sys.stderr)
    # torch/transformers load only now
    from bapo_nemo.embedded.data.tasks import TaskFileError
    from bapo_nemo.embedded.loop.step_metrics import NoLearningSignalError
    from bapo_nemo.embedded.model.policy import ModelLoadError
    from bapo_nemo.embedded.output.checkpoint import CheckpointError
    from bapo_nemo.embedded.output.run_log import append_line
    from bapo_nemo.embedded.output.run_summary import summary_record, summary_text
    from bapo_nemo.embedded.run.resume import ResumeError
    from bapo_nemo.embedded.run.run_lock import OutputDirError, OutputDirLock
    from bapo_nemo.embedded.run.trainer import train
    from bapo_nemo.tracking.store import TrackingConfigError, TrackingUnavailableError

    user_errors = (ResumeError, ModelLoadError, TaskFileError, CheckpointError, TrackingConfigError,
                   TrackingUnavailableError, NoLearningSignalError)
    try:
        with OutputDirLock(output_dir) as lock:
            if lock.stale:
                print(f"note: {lock.path} was left by PID {lock.stale.get('pid', '?')} on host "
                      f"{lock.stale.get('host', '?')}, which ended without releasing it; taking it over",
                      file=sys.stderr)
            try:
                summary = train(config, output_dir, resume=args.resume,
                                warmup_sources=[compared.output_dir] if compared else [])
            except BaseException as exc:  # the run's log ends with the line the console ends with
                line = f"error: {redact_text(str(exc))}" if isinstance(exc, user_errors) else _ending(exc)
                append_line(output_dir, line)
                raise
    except (OutputDirError, *user_errors) as exc:
        print(f"error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        ending = json.dumps(summary_record(summary), indent=2)
    else:
        beside = [compared.run_name, config.logger.mlflow.run_name or Path(output_dir).name] if compared else None
        if beside and beside[0] == beside[1]:  # one name for both: the report takes run ids then
            beside = [compared.run_id, summary["mlflow_run_id"]]
        ending = summary_text(summary, config.logger.mlflow.experiment_name, config.eval.k, _command(args, summary),
                              beside)
    print(redact_text(ending))  # as summary.json holds it: no password of the tracking URI, no token
    from bapo_nemo.embedded.run.interrupts import exit_status

    return exit_status(summary["stopped_by_signal"])


def _with_the_other_startup_problems(first: str, config) -> str:
    """`first` and every problem the config's paths and dataset show without a model, in one message: one
    attempt shows every problem."""
    from bapo_nemo.embedded.run.startup_problems import StartupError, check_paths
    from bapo_nemo.embedded.run.task_source import tokenizer_free_problems

    problems = [first]
    try:
        check_paths(config)
    except StartupError as exc:
        problems += exc.problems
    return str(StartupError(problems + tokenizer_free_problems(config)))


def _warnings_as_lines() -> None:
    """A warning of this package's own (rows skipped, prompts too long) as one line, `warning: ...`, to the
    console and the run's log; a library's warning as Python shows it (its source line says where)."""
    import logging
    import warnings

    from bapo_nemo.embedded.output.run_log import LOGGER

    package = Path(__file__).resolve().parents[2]  # bapo_nemo/
    python_default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if Path(filename).resolve().is_relative_to(package):
            logging.getLogger(LOGGER).warning(f"warning: {message}")
        else:
            python_default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _ending(exc: BaseException) -> str:
    from bapo_nemo.cli import unexpected_error_line

    return "bapo-nemo train: interrupted" if isinstance(exc, KeyboardInterrupt) else unexpected_error_line("train", exc)


def _command(args: argparse.Namespace, summary: dict) -> list[str]:
    """The command line that ran this run, as the user can run it again here."""
    from bapo_nemo.embedded.output.run_summary import shown_path

    command = ["bapo-nemo", "train", args.config, *args.overrides, "--output-dir", shown_path(summary["output_dir"])]
    if args.seed is not None:
        command += ["--seed", str(args.seed)]
    if args.max_steps is not None:
        command += ["--max-steps", str(args.max_steps)]
    if args.no_progress:
        command.append("--no-progress")
    if args.compare_with:
        command += ["--compare-with", args.compare_with]
    return command + (["--resume"] if args.resume else [])


def _compared(compare_with: str, output_dir: str):
    from bapo_nemo.embedded.run.compare import CompareError, compared_run

    if Path(compare_with).resolve() == Path(output_dir).resolve():
        raise CompareError(f"--compare-with {compare_with} is this run's own --output-dir: give the directory of "
                           "the run to compare with, e.g. --compare-with runs/local_cpu")
    return compared_run(compare_with)
