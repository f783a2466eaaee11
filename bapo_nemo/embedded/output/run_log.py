"""The run's own log: one line per RL step and the decisions that matter (resume or fresh start, a skipped
checkpoint, a stop on a signal), appended to `<output_dir>/train.log` and, for batch jobs without a
progress bar, printed to stderr (warnings reach stderr under a bar too). The bar and the lines name each
quantity alike: `train_acc` (the share of the step's responses with a positive reward), `heldout_avg@k`.

    with run_log(output_dir, to_stderr=not progress) as log: log.info("resuming from step 10")
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm

from bapo_nemo.tracking.redact import RedactingFilter

LOG_FILE = "train.log"
LOGGER = "bapo_nemo.embedded.run"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"


@contextmanager
def run_log(output_dir: str | Path, to_stderr: bool):
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the run's lines go to its own file, not to whatever the host app logs
    handlers: list[logging.Handler] = [logging.FileHandler(Path(output_dir) / LOG_FILE, encoding="utf-8")]
    handlers[0].setFormatter(logging.Formatter("%(asctime)s %(message)s", TIME_FORMAT))
    if to_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    else:  # under the progress bar: warnings only, written above the bar
        handlers.append(_AboveTheBar(logging.WARNING))
    handlers[-1].setFormatter(logging.Formatter("%(message)s"))
    for handler in handlers:
        handler.addFilter(RedactingFilter())  # a tracking URI's password or a token never reaches a log
        logger.addHandler(handler)
    try:
        yield logger
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()


def append_line(output_dir: str | Path, message: str) -> None:
    """One line at the end of `<output_dir>/train.log` (e.g. the error that ended the run), timestamped like
    the others; nothing when the run never got a log."""
    path = Path(output_dir) / LOG_FILE
    if path.is_file():
        with path.open("a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime(TIME_FORMAT)} {message}\n")


def heldout_label(k: int) -> str:
    return f"heldout_avg@{k}"


def step_line(step: int, max_steps: int, metrics: dict, k: int) -> str:
    """`step 3/40 reward 0.41 train_acc 0.38 c_low 0.86 c_high 1.31 heldout_avg@4 0.52 2.9s` (held-out when
    evaluated)."""
    parts = [f"step {step}/{max_steps}"]
    for key, label in (("reward/mean", "reward"), ("train/accuracy", "train_acc"), ("bapo/c_low", "c_low"),
                       ("bapo/c_high", "c_high"), ("eval/avg_at_k", heldout_label(k))):
        if metrics.get(key) is not None:
            parts.append(f"{label} {metrics[key]:.3g}")
    if metrics.get("perf/step_time_s") is not None:
        parts.append(f"{metrics['perf/step_time_s']:.1f}s")
    return " ".join(parts)


def progress_postfix(metrics: dict, last_eval: dict, k: int) -> dict[str, str]:
    """The progress bar's fields: this step's reward and bounds, and the latest held-out score with its step."""
    return {
        "reward": f"{metrics['reward/mean']:.2f}",
        heldout_label(k): f"{last_eval['eval/avg_at_k']:.2f} (step {last_eval['step']})",
        "c_low": f"{metrics.get('bapo/c_low', 0):.2f}",
        "c_high": f"{metrics.get('bapo/c_high', 0):.2f}",
    }


class _AboveTheBar(logging.Handler):
    """stderr through tqdm.write, so a warning does not tear the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


class MetricsLog:
    """A JSONL file with one record per step (metrics.jsonl: the local copy of what goes to MLflow). On
    resume, records after the step of the checkpoint resumed from (verified before this is built; written by
    the interrupted process) are dropped; the file is rewritten whole or not at all."""

    def __init__(self, path: Path, keep_up_to: int):
        self.path = path
        if path.is_file():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if keep_up_to >= 0 and json.loads(ln)["step"] <= keep_up_to]
            if len(kept) < len(lines):
                tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
                tmp.write_text("".join(ln + "\n" for ln in kept))
                os.replace(tmp, path)

    def write(self, record: dict) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
