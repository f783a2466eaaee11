"""One run in its own process: `python -m experiments.worker SPEC.json`.

SPEC.json holds {"config": path, "overrides": [...], "output_dir": ..., "warmup_from": dir or null}. The
warm-up cache of the run's seed is copied into the run directory first (the trainer then loads it instead
of repeating the supervised warm-up), and the run resumes from its newest complete checkpoint if an
earlier attempt was interrupted. Exit code 0 only when the run reached grpo.max_num_steps.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from bapo_nemo.embedded.config.run_config import load_config
from bapo_nemo.embedded.run.trainer import train
from bapo_nemo.tracking.mlflow_tracker import MlflowTracker


def seed_warmup_cache(warmup_from: Path, output_dir: Path) -> None:
    """Copy `<warmup_from>/warmup` into the run directory unless it already has one (a resumed run)."""
    source, target = warmup_from / "warmup", output_dir / "warmup"
    if target.exists() or not (source / "info.json").is_file():
        return
    partial = output_dir / "warmup.copying"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    partial.rename(target)  # atomic: a half-copied cache is never mistaken for a usable one


def flush_tracking(summary: dict, experiment: str, output_dir: Path, attempts: int = 6) -> int:
    """Replay what the trainer's tracker could not send (two runs share one sqlite store, so a write can
    meet a locked database); returns the records still waiting (they stay journaled, nothing is lost)."""
    tracker = MlflowTracker(
        summary["mlflow_tracking_uri"],
        experiment,
        run_id=summary["mlflow_run_id"],
        buffer_dir=output_dir / "mlflow_buffer",
    )
    remaining = tracker.flush()
    for _ in range(attempts - 1):
        if remaining == 0:
            break
        time.sleep(5)
        remaining = tracker.flush()
    return remaining


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m experiments.worker SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    output_dir = Path(spec["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    config = load_config(spec["config"], spec["overrides"])
    if spec.get("warmup_from"):
        seed_warmup_cache(Path(spec["warmup_from"]), output_dir)
    summary = train(config, output_dir, resume=True)
    if summary["stopped_by_signal"] or summary["step"] < config.grpo.max_num_steps:
        print(
            f"stopped at step {summary['step']} of {config.grpo.max_num_steps} "
            f"({summary['stopped_by_signal'] or 'incomplete'}); rerun the study to resume",
            file=sys.stderr,
        )
        return 3
    remaining = flush_tracking(summary, config.logger.mlflow.experiment_name, output_dir)
    if remaining:
        print(
            f"{remaining} MLflow records still journaled in {output_dir / 'mlflow_buffer'}; rerun the study to "
            "replay them",
            file=sys.stderr,
        )
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
