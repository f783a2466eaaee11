"""Whether, and from where, a run resumes: the checkpoint (the newest intact one, written with the same
config up to RESUME_HARMLESS_KEYS, read through today's schema so that a key added since compares as its
default) and the MLflow run it continues. Every refusal is a ResumeError saying what to do; nothing is
overwritten."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from bapo_nemo.embedded.config import key_names as config_keys
from bapo_nemo.embedded.config.run_config import RunConfig, deep_merge
from bapo_nemo.embedded.output import checkpoint as ckpt_io
from bapo_nemo.embedded.output.run_log import LOGGER
from bapo_nemo.tracking.redact import redact_nested, redact_text
from bapo_nemo.tracking.store import sqlite_path

log = logging.getLogger(LOGGER)


class ResumeError(RuntimeError):
    """The output directory cannot be resumed (or would be overwritten); the message says what to do."""


# Keys that may differ between a checkpoint and the resumed run: they change how long or how visibly the
# run goes, not what it computes.
RESUME_HARMLESS_KEYS = (
    "grpo.max_num_steps",
    "checkpointing.",
    "grpo.val_period",
    "logger.",
    "tracking.",
    "runtime.",
)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`, values as they are (tracking.redact.flatten turns them into
    MLflow's cut-off strings, which could hide a difference)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ (ignoring RESUME_HARMLESS_KEYS), as `key: checkpoint=X, now=Y`.

    The checkpoint's config is first read through today's schema, so a key added since it was written
    (absent there) compares as its default: a code update between two requeues does not block resume
    unless the run sets that key to something else.
    """
    saved = config_keys.upgrade(saved)  # a checkpoint written before the keys took NeMo-RL's names
    try:
        saved = RunConfig.model_validate(deep_merge(RunConfig().to_dict(), saved)).to_dict()
    except ValidationError:
        pass  # a key was removed since: compare as written, the message names it
    a, b = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if any(key == h or (h.endswith(".") and key.startswith(h)) for h in RESUME_HARMLESS_KEYS):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append(f"{key}: checkpoint={a.get(key, '<absent>')!r}, now={b.get(key, '<absent>')!r}")
    return diffs


def checkpoint_to_resume(output_dir: Path, config_dict: dict, resume: bool) -> Path | None:
    """The checkpoint this run continues from (None: a fresh start in an empty output directory)."""
    latest = ckpt_io.latest_checkpoint(output_dir)
    if latest is None:
        log.info(f"starting fresh in {output_dir}")
        return None
    if not resume:
        raise ResumeError(
            f"{output_dir} already holds checkpoints (newest: {latest.name}); pass --resume to continue that run, "
            "or choose a new --output-dir (nothing was overwritten)"
        )
    # a checkpoint damaged after it was written (full disk, partial copy) is skipped, never resumed from
    latest = ckpt_io.latest_intact_checkpoint(
        output_dir, report=lambda ckpt, why: log.warning(f"skipping checkpoint {ckpt.name}: {why}")
    )
    diffs = config_differences(ckpt_io.load_config_dict(latest), redact_nested(config_dict))  # saved redacted
    if diffs:
        raise ResumeError(
            f"cannot resume from {latest}: it was written with a different config. Differing keys:\n  "
            + "\n  ".join(diffs)
            + "\nResume with the checkpoint's values, or start a new run in another --output-dir."
        )
    log.info(f"resuming from step {ckpt_io.load_training_info(latest).get('step')} ({latest})")
    return latest


STORE_FILE = "mlflow_store"  # beside mlflow_run_id: the store of a run tracked outside its own directory


def tracking_uri_for(configured: str | None, output_dir: Path) -> str:
    """The MLflow store of a run: the configured one; else the one <output_dir>/mlflow_store names (a run
    tracked beside another with --compare-with resumes there without it); else <output_dir>/mlflow.db."""
    if configured:
        return configured
    remembered = output_dir / STORE_FILE
    uri = remembered.read_text().strip() if remembered.is_file() else ""
    return uri or f"sqlite:///{output_dir / 'mlflow.db'}"


def remember_store(output_dir: Path, tracking_uri: str) -> None:
    """Write <output_dir>/mlflow_store for a store other than the run's own default (never one whose URI
    holds a password: the file would keep it); the default needs no note."""
    remembered = output_dir / STORE_FILE
    if tracking_uri == f"sqlite:///{output_dir / 'mlflow.db'}":
        remembered.unlink(missing_ok=True)
    elif redact_text(tracking_uri) == tracking_uri:
        remembered.write_text(tracking_uri + "\n")


def run_to_continue(output_dir: Path, ckpt: Path | None, resume: bool, tracking_uri: str) -> str | None:
    """The MLflow run id to continue: the checkpoint's, or on --resume before any checkpoint (a stop during
    the warm-up) the one <output_dir>/mlflow_run_id records. Refused if its sqlite store is gone, since
    MLflow would silently make an empty one."""
    if ckpt is not None:
        run_id, recorded_in = (
            ckpt_io.load_training_info(ckpt).get("mlflow_run_id"),
            ckpt / "training_info.json",
        )
    else:
        saved = output_dir / "mlflow_run_id"
        run_id = (saved.read_text().strip() or None) if resume and saved.is_file() else None
        recorded_in = saved
    store = sqlite_path(tracking_uri)
    if run_id is not None and store is not None and not store.is_file():
        raise ResumeError(
            f"the MLflow store {store} does not exist, but {recorded_in} records run {run_id} tracked in it: "
            "restore the file from a copy, set logger.mlflow.tracking_uri to the store the run was tracked in, "
            "or start a new run in another --output-dir"
        )
    return run_id
