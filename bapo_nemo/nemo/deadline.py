"""`checkpointing.checkpoint_must_save_by` from the job's real end time, set just before the train loop.

NeMo-RL's `TimeoutChecker` counts that duration from the loop's start, so a value fixed when the job
starts must guess the set-up time; computed after set-up it is exact: time left until the job's end minus
a margin for one save and the exit. The end comes from `BAPO_JOB_END_EPOCH` (the batch script) or
`SLURM_JOB_END_TIME`; with neither, or with a value already in the config, nothing changes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, MutableMapping

END_ENV = ("BAPO_JOB_END_EPOCH", "SLURM_JOB_END_TIME")
MARGIN_ENV = "BAPO_SAVE_MARGIN_SEC"
DEFAULT_MARGIN_SEC = 900


def job_end_epoch(environ: Mapping[str, str]) -> float | None:
    for name in END_ENV:
        value = environ.get(name, "").strip()
        if value:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a Unix time in seconds; unset it or fix it") from None
    return None


def ddhhmmss(seconds: float) -> str:
    """NeMo-RL's duration format (`nemo_rl.utils.timer.convert_to_seconds` reads it back)."""
    s = max(0, int(seconds))
    return f"{s // 86400:02d}:{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def save_by(end_epoch: float, now: float, margin_sec: float) -> str:
    """Duration from `now` after which the train loop must checkpoint and stop. 0 when the margin is
    already gone: the loop then saves after its first step, so every attempt makes progress if one
    step fits."""
    return ddhhmmss(end_epoch - now - margin_sec)


def apply_job_deadline(
    checkpointing: MutableMapping, environ: Mapping[str, str] | None = None, now: float | None = None
) -> str | None:
    """Set `checkpointing["checkpoint_must_save_by"]` from the job's end; call it just before grpo_train."""
    environ = os.environ if environ is None else environ
    end = job_end_epoch(environ)
    if end is None or checkpointing.get("checkpoint_must_save_by") is not None:
        return None
    try:
        margin = float(environ.get(MARGIN_ENV) or DEFAULT_MARGIN_SEC)
    except ValueError:
        raise ValueError(f"{MARGIN_ENV}={environ[MARGIN_ENV]!r} is not a number of seconds") from None
    now = time.time() if now is None else now
    value = save_by(end, now, margin)
    checkpointing["checkpoint_must_save_by"] = value
    print(
        f"checkpoint_must_save_by={value}: the job ends in {int(end - now)}s, {int(margin)}s kept for the "
        "last save and exit (the step time is NeMo-RL's measured mean)",
        flush=True,
    )
    return value
