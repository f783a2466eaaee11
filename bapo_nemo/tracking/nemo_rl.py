"""MLflow for NeMo-RL runs (v0.7.0 and main), through NeMo-RL's own `MLflowLogger` (docs/tracking.md).

    config = prepare_logger_config(config)   # before setup(): MLflow on, sqlite default, run id resumed
    ... = setup(MasterConfig(**config), ...)
    tracker = after_setup(config, logger)     # after setup(): tags, params, artifacts, the journal
    grpo_train(...); finish_nemo_tracking(tracker)
A step's metrics are sent once a complete checkpoint covers it; `log_hyperparams` is wrapped to redact.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bapo_nemo.tracking.filesystems import network_filesystem
from bapo_nemo.tracking.mlflow_tracker import _PERMANENT_ERRORS, MlflowTracker, _error_code
from bapo_nemo.tracking.redact import redact_nested, redact_text
from bapo_nemo.tracking.store import (
    HTTP_ENV_DEFAULTS,
    TrackingConfigError,
    check_tracking_uri,
    is_remote,
    sqlite_artifact_root,
)
from bapo_nemo.tracking.tags import default_tags

log = logging.getLogger(__name__)

RUN_FILE = "mlflow_run.json"
JOURNAL_DIR = "mlflow_journal"
DEFAULT_EXPERIMENT = "bapo-nemo"


def _as_dict(master_config: Any) -> dict:
    if hasattr(master_config, "model_dump"):  # v0.7.0's MasterConfig is pydantic
        return master_config.model_dump()
    if not isinstance(master_config, Mapping):
        raise TypeError(f"master_config must be a dict (or NeMo-RL MasterConfig), got {type(master_config).__name__}")
    return dict(master_config)


def _checkpoint_dir(config: Mapping) -> Path | None:
    ckpt = config.get("checkpointing") or {}
    if not ckpt.get("enabled", True) or not ckpt.get("checkpoint_dir"):
        return None
    return Path(ckpt["checkpoint_dir"])


_COMPLETE_CHECKPOINT = re.compile(r"step_(\d+)")  # NeMo-RL renames tmp_step_N to step_N once it is complete


def newest_checkpoint_step(checkpoint_dir: str | Path) -> int | None:
    """The step of the newest complete checkpoint ``step_N`` in ``checkpoint_dir`` (one listing), else None."""
    try:
        names = os.listdir(checkpoint_dir)
    except FileNotFoundError:
        return None
    steps = [int(m.group(1)) for m in map(_COMPLETE_CHECKPOINT.fullmatch, names) if m]
    return max(steps, default=None)


def _has_checkpoint(checkpoint_dir: Path) -> bool:
    return newest_checkpoint_step(checkpoint_dir) is not None


def journal_dir(config: Mapping) -> Path:
    """Where the run's MLflow journal lives: beside the checkpoints (every attempt of a requeued job finds
    it there, while ``logger.log_dir`` is a new ``exp_NNN`` per attempt), else under ``logger.log_dir``."""
    checkpoint_dir = _checkpoint_dir(config)
    if checkpoint_dir is not None:
        return checkpoint_dir / JOURNAL_DIR
    return Path((config.get("logger") or {}).get("log_dir") or "logs") / "mlflow_buffer"


def read_saved_run(checkpoint_dir: str | Path) -> dict | None:
    path = Path(checkpoint_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TrackingConfigError(f"{path} is not valid JSON ({exc}); delete it to start a new MLflow run") from exc
    if not saved.get("run_id"):
        raise TrackingConfigError(f"{path} has no run_id; delete it to start a new MLflow run")
    return saved


def _warn_if_sqlite_on_network_fs(uri: str) -> None:
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri.removeprefix("sqlite:///"))
    fs_type = network_filesystem(db.parent)
    if fs_type:
        log.warning(
            "MLflow store %s is on %s: SQLite locking is unreliable on network filesystems; on a cluster "
            "run an MLflow server and set MLFLOW_TRACKING_URI=http://host:port (docs/tracking.md)", db, fs_type
        )


def prepare_logger_config(master_config: dict) -> dict:
    """Return a copy of ``master_config`` with v0.7.0's MLflow logger turned on and configured."""
    config = copy.deepcopy(_as_dict(master_config))
    logger_cfg = config.get("logger")
    if not isinstance(logger_cfg, Mapping):
        raise TrackingConfigError("config has no 'logger:' section: NeMo-RL's GRPO configs need logger.log_dir etc.")
    logger_cfg = dict(logger_cfg)
    log_dir = logger_cfg.get("log_dir") or "logs"
    mlflow_cfg = dict(logger_cfg.get("mlflow") or {})

    uri = mlflow_cfg.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = f"sqlite:///{Path(log_dir).resolve() / 'mlflow.db'}"
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    try:
        check_tracking_uri(uri)
    except TrackingConfigError as exc:
        raise TrackingConfigError(f"logger.mlflow.tracking_uri: {exc}") from exc
    mlflow_cfg["tracking_uri"] = uri
    _warn_if_sqlite_on_network_fs(uri)
    mlflow_cfg["experiment_name"] = mlflow_cfg.get("experiment_name") or DEFAULT_EXPERIMENT
    if not mlflow_cfg.get("run_name"):
        checkpoint_dir = _checkpoint_dir(config)
        mlflow_cfg["run_name"] = checkpoint_dir.name if checkpoint_dir else None
    if not mlflow_cfg.get("artifact_location"):
        # v0.7.0 falls back to the driver's log_dir, which with a server strands artifacts on one node.
        if is_remote(uri):
            mlflow_cfg["artifact_location"] = f"mlflow-artifacts:/{mlflow_cfg['experiment_name']}"
        else:
            mlflow_cfg["artifact_location"] = sqlite_artifact_root(uri, mlflow_cfg["experiment_name"])

    checkpoint_dir = _checkpoint_dir(config)
    if not mlflow_cfg.get("run_id") and checkpoint_dir is not None and _has_checkpoint(checkpoint_dir):
        saved = read_saved_run(checkpoint_dir)
        if saved is not None:
            if saved.get("tracking_uri") not in (None, redact_text(uri)):  # the file holds it redacted
                log.warning("%s: run %s was tracked at %s, now %s; resuming the id anyway",
                            checkpoint_dir / RUN_FILE, saved["run_id"], saved["tracking_uri"], redact_text(uri))
            mlflow_cfg["run_id"] = saved["run_id"]
    logger_cfg["mlflow_enabled"] = True
    logger_cfg["mlflow"] = mlflow_cfg
    config["logger"] = logger_cfg

    if is_remote(uri):
        for var, value in HTTP_ENV_DEFAULTS.items():
            os.environ.setdefault(var, value)
    _redact_nemo_rl_hyperparams()
    return config


def _redact_nemo_rl_hyperparams() -> None:
    """Wrap v0.7.0's ``MLflowLogger.log_hyperparams``: secrets redacted, and a resumed run keeps its params.

    MLflow refuses to change a logged param, and a resumed job's config always differs somewhere
    (``logger.log_dir`` becomes the next ``exp_NNN``), so v0.7.0's call would fail on every resume: only
    the keys the run does not have yet are logged; changed values keep their first value, with a warning."""
    try:
        from nemo_rl.utils import logger as nemo_logger_module
    except (ImportError, RuntimeError):  # not in the container (RuntimeError: transformer-engine without CUDA)
        return
    cls = nemo_logger_module.MLflowLogger
    if getattr(cls.log_hyperparams, "_bapo_redacting", False):
        return
    original = cls.log_hyperparams

    def log_hyperparams(self, params):
        flat = nemo_logger_module.flatten_dict(redact_nested(params))  # what v0.7.0 logs (logger.py:913)
        import mlflow  # the tracking URI is the one v0.7.0's MLflowLogger set

        try:
            _log_new_hyperparams(self, flat, mlflow, original)
        except Exception as exc:
            if _error_code(exc) in _PERMANENT_ERRORS:
                raise
            log.warning("MLflow server unreachable while NeMo-RL logs its config (%s); the params are journaled "
                        "once set-up is done", redact_text(str(exc).splitlines()[0][:200]))
            _SETUP_BACKLOG["params"].update(flat)

    log_hyperparams._bapo_redacting = True
    cls.log_hyperparams = log_hyperparams

    original_log_metrics = cls.log_metrics

    def log_metrics(self, metrics, step, *args, **kwargs):  # set-up's own (after it: journaled, see after_setup)
        try:
            original_log_metrics(self, metrics, step, *args, **kwargs)
        except Exception as exc:
            if _error_code(exc) in _PERMANENT_ERRORS:
                raise
            log.warning("MLflow server unreachable while NeMo-RL sets up (%s); step %s's metrics are journaled once "
                        "set-up is done", redact_text(str(exc).splitlines()[0][:200]), step)
            _SETUP_BACKLOG["metrics"].append((metrics, step, args, kwargs))

    cls.log_metrics = log_metrics


# What NeMo-RL's set-up sent to MLflow directly and the server did not take (down, or slower than the short
# HTTP timeout): journaled by after_setup, so a slow server at start-up no longer ends the job.
_SETUP_BACKLOG: dict[str, Any] = {"params": {}, "metrics": []}


def _log_new_hyperparams(backend, flat: dict, mlflow, original) -> None:
    """Only the keys the run does not have yet (a resumed run keeps its first values)."""
    logged = mlflow.get_run(backend.run_id).data.params if backend.run_id else {}
    changed = sorted(k for k in flat if k in logged and str(flat[k])[:6000] != logged[k])
    if changed:
        log.warning("resumed MLflow run %s keeps its first values for %d changed params: %s",
                    backend.run_id, len(changed), ", ".join(changed[:10]) + (" ..." if len(changed) > 10 else ""))
    fresh = {k: v for k, v in flat.items() if k not in logged}
    if fresh:
        original(backend, fresh)  # flat keys flatten to themselves


def find_mlflow_logger(nemo_logger: Any) -> Any:
    """The ``MLflowLogger`` among ``nemo_rl.utils.logger.Logger.loggers``."""
    for backend in getattr(nemo_logger, "loggers", []):
        if type(backend).__name__.endswith("MLflowLogger") and hasattr(backend, "run_id"):
            return backend
    raise TrackingConfigError(
        "NeMo-RL logger has no MLflowLogger: call prepare_logger_config(config) before grpo.setup(...) "
        "(it sets logger.mlflow_enabled: true)"
    )


def after_setup(master_config: dict, nemo_logger, resumed_step: int | None = None,
                logged_through: int | None = None) -> MlflowTracker:
    """Add our tags, params and artifacts to NeMo-RL's active MLflow run; keep its id with the checkpoints;
    route the logger's metrics through the outage-proof journal. Returns the run's tracker (for tags the
    driver adds later, and for :func:`finish_nemo_tracking`).

    With checkpointing on, a step's metrics are sent only once a complete checkpoint covers the step
    (a resumed attempt runs the later steps again, and MLflow cannot delete a logged point), and the
    journal lives in ``<checkpoint_dir>/mlflow_journal``. ``resumed_step`` is the step of the checkpoint
    setup() loaded (0 for a fresh run); None reads it from the checkpoint directory, which at this point
    holds exactly what setup() resumed from. Journaled records of later steps are set aside.
    ``logged_through``: the step of the newest checkpoint setup() skipped as damaged; the attempt that completed
    it logged its steps, so MLflow keeps those and this attempt's new records of them are kept aside."""
    config = _as_dict(master_config)
    mlflow_cfg = config["logger"]["mlflow"]
    backend = find_mlflow_logger(nemo_logger)
    run_id = backend.run_id
    log_dir = Path(config["logger"].get("log_dir") or "logs")
    checkpoint_dir = _checkpoint_dir(config)
    gate = None
    if checkpoint_dir is not None:
        def gate() -> int:  # -1: no checkpoint yet, so no step may go
            newest = newest_checkpoint_step(checkpoint_dir)
            return -1 if newest is None else newest
    tracker = MlflowTracker(mlflow_cfg["tracking_uri"], mlflow_cfg["experiment_name"], run_id=run_id,
                            buffer_dir=journal_dir(config), sendable_step=gate)
    if checkpoint_dir is not None:
        if resumed_step is None:
            resumed_step = newest_checkpoint_step(checkpoint_dir) or 0
        # Steps up to a damaged newer checkpoint that setup() skipped were logged by the attempt that completed
        # it (sent, or journaled and sent now): MLflow keeps those; this attempt's re-run of them is kept aside.
        completed = max(resumed_step, logged_through or 0)
        _set_aside_steps_run_again(tracker, completed)
        if completed > resumed_step:
            tracker.set_aside_steps_already_sent(resumed_step + 1, completed)
            log.warning("steps %d-%d were logged by the attempt that completed step_%d (now damaged): this attempt "
                        "runs them again and keeps its new metrics of them in %s", resumed_step + 1, completed,
                        completed, tracker.journal.superseded_path)
    bapo_block = (config.get("loss_fn") or {}).get("bapo")
    tags = {**default_tags(config), "bapo.runtime": "nemo_rl", "bapo.enabled": str(bool(bapo_block and
            bapo_block.get("enabled", True))).lower()}
    # NeMo-RL already logged the (now redacted) config as params; ours only adds keys it did not write.
    # NeMo-RL's params that set-up could not send go through the journal (start() logs only new keys).
    backlog_params, _SETUP_BACKLOG["params"] = _SETUP_BACKLOG["params"], {}
    tracker.start({**backlog_params, **({"bapo": bapo_block} if bapo_block else {})}, tags)
    _log_config_artifact(tracker, config, log_dir)

    if checkpoint_dir is not None:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint_dir / (RUN_FILE + ".tmp")
        tmp.write_text(json.dumps(redact_nested({"run_id": run_id, "tracking_uri": mlflow_cfg["tracking_uri"],
                                                 "experiment_name": mlflow_cfg["experiment_name"]}), indent=2))
        os.replace(tmp, checkpoint_dir / RUN_FILE)
    _journal_logger_metrics(backend, tracker)
    backlog_metrics, _SETUP_BACKLOG["metrics"] = _SETUP_BACKLOG["metrics"], []
    for metrics, step, args, kwargs in backlog_metrics:
        backend.log_metrics(metrics, step, *args, **kwargs)
    return tracker


def _set_aside_steps_run_again(tracker: MlflowTracker, resumed_step: int) -> None:
    """Records of steps after ``resumed_step`` that an earlier attempt journaled and never sent: this
    attempt computes those steps again, so sending both would log each step twice."""
    records = tracker.set_aside_steps_after(resumed_step)
    if records:
        steps = [r["step"] for r in records]
        after = f"after checkpoint step_{resumed_step}" if resumed_step else "before the run's first checkpoint"
        log.warning("%d metric record%s of step%s %s, logged by an earlier attempt %s, set aside in %s: "
                    "those steps are run again", len(records), "s" * (len(records) != 1),
                    "s" * (len(set(steps)) != 1), _step_ranges(steps), after, tracker.journal.superseded_path)


def finish_nemo_tracking(tracker: MlflowTracker, status: str = "FINISHED") -> list[int]:
    """At the end of a run: send the metrics still held because no checkpoint covers their steps, then
    mark the run ``status``. Returns those steps (they are in no checkpoint, so a later resume from the
    newest checkpoint would run them again and log them twice)."""
    steps = tracker.release_held()
    if steps:
        log.warning("MLflow run %s: steps %s are in no checkpoint; their metrics are sent now, and a later "
                    "resume from the newest checkpoint would run (and log) them again", tracker.run_id,
                    _step_ranges(steps))
    tracker.finish(status)
    return steps


def _step_ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    ordered = sorted(set(steps))
    ranges, first = [], ordered[0]
    for previous, step in zip(ordered, ordered[1:] + [None]):
        if step != previous + 1:
            ranges.append(str(first) if first == previous else f"{first}-{previous}")
            first = step
    return ", ".join(ranges)


def _log_config_artifact(tracker: MlflowTracker, config: dict, log_dir: Path) -> None:
    import yaml

    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "resolved_config.yaml"
    plain = json.loads(json.dumps(redact_nested(config), default=str))
    path.write_text(yaml.safe_dump(plain, sort_keys=False))
    tracker.log_artifact(path, artifact_path="config")


def _journal_logger_metrics(backend: Any, tracker: MlflowTracker) -> None:
    """Replace the backend's ``log_metrics``/``log_plot`` (instance attributes only) with journaled ones that
    name metrics exactly as v0.7.0 does (same flattening helpers from the backend's own module)."""
    module = sys.modules.get(type(backend).__module__)
    flatten_dict = getattr(module, "flatten_dict", _flatten_slash)
    merge_workers = getattr(module, "_merge_generation_logger_workers", lambda m: m)
    summarize_list = getattr(module, "_summarize_list", None)

    def log_metrics(metrics, step, prefix="", step_metric=None, step_finished=False):
        metrics = merge_workers(metrics)
        out: dict[str, float] = {}
        for name, value in flatten_dict(metrics, sep="/", expand_lists=False).items():
            name = f"{prefix}/{name}" if prefix else name
            if isinstance(value, list):
                if summarize_list is not None:
                    for suffix, stat in summarize_list(value).items():
                        out[f"{name}/{suffix}"] = float(stat)
            else:
                try:
                    out[name] = float(value)
                except (TypeError, ValueError):
                    log.debug("skipping non-numeric metric %s=%r", name, value)
        if out:  # the GPU monitor's steps (it passes step_metric) are seconds, not training steps
            tracker.log_metrics(out, step=step, gated=step_metric is None)

    def log_plot(figure, step, name):
        tracker.log_figure(figure, f"plots/{name}.png")

    backend.log_metrics = log_metrics
    backend.log_plot = log_plot
    backend._bapo_tracker = tracker


def _flatten_slash(metrics: Mapping, sep: str = "/", expand_lists: bool = False, prefix: str = "") -> dict:
    """Fallback with v0.7.0's naming (nested keys joined by '/') when the backend module has no flatten_dict."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten_slash(value, sep, expand_lists, name))
        else:
            out[name] = value.tolist() if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0 else value
    return out
