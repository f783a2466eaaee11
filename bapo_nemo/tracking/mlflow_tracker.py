"""MLflow tracking that never stalls or loses a training run (docs/tracking.md, "Outages").

Every record is appended to the fsync'd journal (`tracking.journal`) and then sent; a cursor makes replays
resume exactly after the last accepted record. An unreachable server is retried every `retry_interval_s`
while journaling goes on; rejected records move aside so they cannot block the queue; a `sendable_step`
gate holds later steps on disk (NeMo-RL: until a checkpoint covers them). Secrets go through
`tracking.redact`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bapo_nemo.tracking.journal import Journal
from bapo_nemo.tracking.redact import flatten_and_redact, redact, redact_nested, redact_text
from bapo_nemo.tracking.store import (
    HTTP_ENV_DEFAULTS,
    TrackingConfigError,
    TrackingUnavailableError,
    check_tracking_uri,
    is_remote,
    sqlite_artifact_root,
    store_lock,
)

log = logging.getLogger(__name__)

# MLflow error codes that mean "this record will never be accepted", as opposed to an outage.
_PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS"}
_METRICS_PER_BATCH = 1000  # MLflow log_batch limits
_PARAMS_PER_BATCH = 100
_TAGS_PER_BATCH = 100
_PROGRESS_MIN_RECORDS = 200
# The experiment tag MLflow 3 uses to tell a training experiment from a GenAI one (its UI writes it when a
# user picks the type; the UIs that introduced experiment types open the experiment in the view it names).
# The UI of MLflow 3.17 picks the view from its sidebar's GenAI / Model training switch instead (the
# `workflowType` URL parameter, else the browser's last choice; docs/tracking.md), so the UI link a run
# prints carries that parameter.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_EXPERIMENT_KIND = "custom_model_development"


def _error_code(exc: BaseException) -> str | None:
    return getattr(exc, "error_code", None)


class MlflowTracker:
    """One MLflow run, written through a local journal (see the module docstring).

    ``retry_interval_s``: after a failed send, skip sending for this long (records keep journaling).
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment_name: str,
        run_name: str | None = None,
        run_id: str | None = None,
        buffer_dir: str | Path | None = None,
        *,
        retry_interval_s: float = 30.0,
        sendable_step: Callable[[], int | None] | None = None,
    ) -> None:
        self.tracking_uri = check_tracking_uri(tracking_uri)
        self.shown_uri = redact_text(self.tracking_uri)  # for messages: never the password of the URI
        if not experiment_name:
            raise TrackingConfigError("experiment_name is empty: give the MLflow experiment a name")
        self.experiment_name = redact_text(experiment_name)
        self.run_name = redact_text(run_name) if run_name is not None else None
        if self.run_name != run_name:
            log.warning("the MLflow run name looks like a secret (a token or a URL with a password); the run "
                        "is named %r instead", self.run_name)
        self._run_id = run_id
        self.experiment_id: str | None = None  # known once start() reached the store
        self.buffer_dir = Path(buffer_dir) if buffer_dir is not None else Path.cwd() / ".bapo_mlflow_buffer"
        self.retry_interval_s = retry_interval_s
        if is_remote(self.tracking_uri):
            for var, value in HTTP_ENV_DEFAULTS.items():
                os.environ.setdefault(var, value)
        from mlflow.tracking import MlflowClient

        with store_lock(self.tracking_uri):  # the client opens (and, the first time, creates) the store
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.journal: Journal | None = None
        self.sendable_step = sendable_step
        self._sendable_up_to: int | None = None  # the gate's newest answer (None: not asked yet)
        self._holding = sendable_step is not None
        self._already_sent_steps = range(0)  # set_aside_steps_already_sent
        self._lock = threading.RLock()  # NeMo-RL's GPU monitor logs from its own thread
        self._offline_until = 0.0
        self._finished = False
        self._single_records = 0  # > 0: send records one by one (isolating a rejected one)
        self._existing_params: dict[str, str] | None = None
        if run_id is not None:
            self._open_journal()

    # ---- public API (contract 2) -------------------------------------------------------------------
    @property
    def run_id(self) -> str | None:
        return self._run_id

    @property
    def _pending(self) -> list[dict[str, Any]]:
        return self.journal.pending if self.journal is not None else []

    def start(self, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        """Create the run (or resume ``run_id``), log flattened + redacted params and tags; return the run id.

        Resuming works while the server is down (records are journaled). Creating a new run needs the
        server: without it there is no run id, and :class:`TrackingUnavailableError` says so.
        """
        flat_params = flatten_and_redact(params)
        safe_tags = redact({str(k): str(v) for k, v in tags.items()})
        if self._run_id is None:
            self._create_run(safe_tags)
            self._open_journal()
            self._log_resolved_config(params)
        else:
            # A status an earlier process journaled but never delivered is superseded: this run goes on.
            self.journal.pending = [r for r in self.journal.pending if r["kind"] != "terminate"]
            if self._resume_run():
                safe_tags = {**safe_tags, "bapo.resumed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            flat_params = self._params_not_yet_logged(flat_params)
        if flat_params:
            self._journal({"kind": "params", "params": flat_params})
        if safe_tags:
            self._journal({"kind": "tags", "tags": safe_tags})
        self._send_pending()
        return self._run_id  # type: ignore[return-value]

    def log_metrics(self, metrics: Mapping[str, float], step: int, *, gated: bool = True) -> None:
        """Journal then send; never raises because the server is down (the data waits on disk).

        With a ``sendable_step`` gate the record waits until ``sendable_step() >= step``; ``gated=False``
        is for metrics whose step is not a training step (e.g. seconds of a clock), which never wait."""
        self._require_started()
        timestamp = int(time.time() * 1000)
        values = {}
        for key, value in metrics.items():
            try:
                values[str(key)] = float(value)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"metric {key!r} at step {step} is not a number: {value!r}") from exc
        if values:
            record = {"kind": "metrics", "step": int(step), "timestamp": timestamp, "metrics": values}
            with self._lock:
                self._journal(record if gated else {**record, "ungated": True})
                if gated and int(step) in self._already_sent_steps:
                    self.journal.set_aside(lambda r: r is self.journal.pending[-1])
            self._send_pending()

    def log_tags(self, tags: Mapping[str, str]) -> None:
        """Set run tags (e.g. a warning the UI should show on the run's page); journaled like metrics."""
        self._require_started()
        self._journal({"kind": "tags", "tags": redact({str(k): str(v) for k, v in tags.items()})})
        self._send_pending()

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or directory; when the server is down a copy waits in the buffer directory."""
        self._require_started()
        source = Path(local_path)
        if not source.exists():
            raise FileNotFoundError(f"log_artifact: {source} does not exist")
        staged = self.journal.staging_dir / uuid.uuid4().hex / source.name
        staged.parent.mkdir(parents=True, exist_ok=True)
        # A copy, because the caller may overwrite or delete the file before an outage ends.
        if source.is_dir():
            shutil.copytree(source, staged)
        else:
            shutil.copy2(source, staged)
        self._journal({"kind": "artifact", "path": str(staged), "artifact_path": artifact_path})
        self._send_pending()

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        """Log rows (e.g. sample generations) as an MLflow table artifact (shows in the UI's table view)."""
        self._require_started()
        if not artifact_file.endswith(".json"):
            raise ValueError(f"log_table: artifact_file must end with .json (MLflow table format), got {artifact_file!r}")
        columns: list[str] = []
        for row in rows:
            columns.extend(k for k in row if k not in columns)
        table = {c: [_jsonable(row.get(c)) for row in rows] for c in columns}
        self._journal({"kind": "table", "data": table, "artifact_file": artifact_file})
        self._send_pending()

    def log_figure(self, figure, artifact_file: str) -> None:
        """Save a matplotlib figure as PNG and log it (journaled like any artifact)."""
        staged = self.journal.staging_dir / uuid.uuid4().hex / Path(artifact_file).name
        staged.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(staged, bbox_inches="tight")
        parent = str(Path(artifact_file).parent)
        self._journal({"kind": "artifact", "path": str(staged), "artifact_path": None if parent == "." else parent})
        self._send_pending()

    def flush(self) -> int:
        """Send every journaled record the gate lets through now (ignoring the back-off); return how many
        are still waiting (held by the gate or by an outage)."""
        if self._run_id is None:
            return 0
        with self._lock:
            self._offline_until = 0.0
            self._send_pending()
            return len(self._pending)

    def held_steps(self) -> list[int]:
        """The steps of metric records the ``sendable_step`` gate holds now, in queue order, no repeats."""
        with self._lock:
            gated = [r["step"] for r in self._pending if self._gated(r)]
            limit = self._ask_gate() if gated else None
            return list(dict.fromkeys(step for step in gated if limit is not None and step > limit))

    def release_held(self) -> list[int]:
        """Stop holding records for the gate (e.g. the run ended cleanly past its last checkpoint), send
        what can be sent, and return the steps that were held."""
        with self._lock:
            steps = self.held_steps()
            self._holding = False
            self._send_pending()
            return steps

    def set_aside_steps_after(self, step: int) -> list[dict[str, Any]]:
        """Take the journaled metric records of training steps after ``step`` out of the queue (into
        ``<run_id>.superseded.jsonl``, kept): a run resumed from ``step`` computes those steps again.
        Call before ``start()``; returns the records set aside."""
        with self._lock:
            if self.journal is None:
                return []
            return self.journal.set_aside(
                lambda r: r["kind"] == "metrics" and not r.get("ungated") and r["step"] > step)

    def set_aside_steps_already_sent(self, first: int, last: int) -> None:
        """Metric records of training steps ``first``..``last`` logged from now on go to
        ``<run_id>.superseded.jsonl`` (kept), not to MLflow: an earlier attempt logged those steps, and this
        one runs them again (their checkpoint was found damaged), so sending both would log them twice."""
        self._already_sent_steps = range(first, last + 1)

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the run terminated (FINISHED, FAILED, KILLED) after replaying the journal."""
        if self._run_id is None or self._finished:
            return
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"finish: status must be FINISHED, FAILED or KILLED, got {status!r}")
        self._journal({"kind": "terminate", "status": status})
        remaining = self.flush()
        self._finished = True
        if remaining:
            log.warning(
                "MLflow server %s unreachable or records held: %d records of run %s wait in %s; they are "
                "replayed the next time MlflowTracker(run_id=%r, buffer_dir=...) opens this run and calls flush()",
                self.shown_uri, remaining, self._run_id, self.journal.path, self._run_id,
            )

    # ---- run creation / resumption ---------------------------------------------------------------
    def _create_run(self, tags: dict[str, str]) -> None:
        try:
            with store_lock(self.tracking_uri):  # two new runs must not both create the experiment
                experiment_id = self._experiment_id()
            run = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags)
            self.experiment_id = experiment_id
        except TrackingConfigError:
            raise
        except Exception as exc:
            raise TrackingUnavailableError(
                f"could not create an MLflow run in experiment {self.experiment_name!r} at {self.shown_uri}: "
                f"{redact_text(str(exc))}. Start the tracking server (or use sqlite:///<dir>/mlflow.db) and retry."
            ) from exc
        self._run_id = run.info.run_id

    def _experiment_id(self) -> str:
        """The experiment's id, created when missing (a server shared with another run that created it a
        moment earlier answers RESOURCE_ALREADY_EXISTS: then it is read back). A new experiment is created as
        a training one; an existing one without a kind is tagged so (a kind someone chose stays)."""
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is None:
            try:
                return self.client.create_experiment(
                    self.experiment_name,
                    artifact_location=sqlite_artifact_root(self.tracking_uri, self.experiment_name),
                    tags={EXPERIMENT_KIND_TAG: TRAINING_EXPERIMENT_KIND},
                )
            except Exception as exc:
                if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment.lifecycle_stage == "deleted":
            raise TrackingConfigError(
                f"MLflow experiment {self.experiment_name!r} is deleted: restore it in the MLflow UI or "
                "choose another experiment name"
            )
        self._mark_training_experiment(experiment)
        return experiment.experiment_id

    def _mark_training_experiment(self, experiment) -> None:
        """Tag an experiment that has no kind yet as a training one (a kind someone chose stays)."""
        if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):
            self.client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT_KIND)

    def _log_resolved_config(self, params: Mapping[str, Any]) -> None:
        """The resolved config as a YAML artifact (secrets redacted), next to the flattened params."""
        import yaml

        staged = self.journal.staging_dir / uuid.uuid4().hex / "resolved_config.yaml"
        staged.parent.mkdir(parents=True, exist_ok=True)
        plain = json.loads(json.dumps(redact_nested(dict(params)), default=str))  # Paths, enums -> text
        staged.write_text(yaml.safe_dump(plain, sort_keys=False))
        self._journal({"kind": "artifact", "path": str(staged), "artifact_path": "config"})

    def _resume_run(self) -> bool:
        """Attach to the existing run; True when it already holds metrics (a continuation, not a fresh run
        created by someone else such as NeMo-RL's logger). Unknown while the server is down: True."""
        try:
            run = self.client.get_run(self._run_id)
        except Exception as exc:
            if _error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
                raise TrackingConfigError(
                    f"MLflow run {self._run_id!r} does not exist at {self.shown_uri}: it was tracked in another "
                    "store; point the tracking URI at that store"
                ) from exc
            log.warning("MLflow server %s unreachable while resuming run %s; journaling to %s (%s)",
                        self.shown_uri, self._run_id, self.buffer_dir, redact_text(str(exc)))
            self._offline_until = time.monotonic() + self.retry_interval_s
            return True
        self._existing_params = dict(run.data.params)
        self.experiment_id = run.info.experiment_id
        try:  # e.g. NeMo-RL's logger made the experiment; cosmetic, so never fatal
            self._mark_training_experiment(self.client.get_experiment(self.experiment_id))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not tag experiment %s as a training experiment: %s", self.experiment_id,
                        redact_text(str(exc)))
        if run.info.status != "RUNNING":
            try:
                self.client.update_run(self._run_id, status="RUNNING")
            except Exception as exc:  # noqa: BLE001 - status is cosmetic; metrics matter
                log.warning("could not mark run %s RUNNING: %s", self._run_id, exc)
        return bool(run.data.metrics)

    def _params_not_yet_logged(self, params: dict[str, str]) -> dict[str, str]:
        """MLflow params are immutable: on resume log only new keys; record changed ones as a tag."""
        existing = self._existing_params
        if existing is None:
            return params
        changed = sorted(k for k, v in params.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("resumed run %s: params changed since the run started (kept the old values): %s",
                        self._run_id, ", ".join(changed))
            self._journal({"kind": "tags", "tags": {"bapo.params_changed_on_resume": ",".join(changed)[:5000]}})
        return {k: v for k, v in params.items() if k not in existing}

    # ---- journal and gate --------------------------------------------------------------------------
    def _open_journal(self) -> None:
        """Open this run's journal; records an earlier process left unacknowledged are replayed."""
        self.journal = Journal(self.buffer_dir, self._run_id)
        if self.journal.pending:
            log.info("run %s: %d journaled records from an earlier process will be replayed", self._run_id,
                     len(self.journal.pending))

    def _journal(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.journal.append(record)

    def _reject(self, record: dict[str, Any], exc: BaseException) -> None:
        path = self.journal.reject(record, redact_text(str(exc)))
        log.error("MLflow rejected record %d of run %s (%s); kept in %s", record["seq"], self._run_id,
                  redact_text(str(exc)), path)

    def _ask_gate(self) -> int | None:
        """The highest step the gate lets through now (None: no limit). Its answer can only grow (a newer
        checkpoint), so a smaller one keeps the earlier answer."""
        try:
            answer = self.sendable_step()
        except OSError as exc:  # e.g. the checkpoint directory briefly unreadable: ask again next time
            log.warning("MLflow run %s: could not ask which steps may be sent (%s); holding them", self._run_id, exc)
            return self._sendable_up_to if self._sendable_up_to is not None else -1
        if answer is None:
            return None
        self._sendable_up_to = answer if self._sendable_up_to is None else max(self._sendable_up_to, answer)
        return self._sendable_up_to

    def _gated(self, record: dict[str, Any]) -> bool:
        return self._holding and record["kind"] == "metrics" and not record.get("ungated")

    def _sendable_count(self) -> int:
        """How many records at the head of the queue may go now: a held record holds every one after it
        (the cursor acknowledges a prefix). The gate is asked at most once per call, and only when a
        record's step is past its last answer."""
        limit, asked = self._sendable_up_to, False
        for index, record in enumerate(self._pending):
            if not self._gated(record) or (limit is not None and record["step"] <= limit):
                continue
            if not asked:
                limit, asked = self._ask_gate(), True
                if limit is None:
                    return len(self._pending)
                if record["step"] <= limit:
                    continue
            return index
        return len(self._pending)

    # ---- sending ---------------------------------------------------------------------------------
    def _send_pending(self) -> None:
        with self._lock:
            if not self._pending or time.monotonic() < self._offline_until:
                return
            sendable = self._sendable_count()
            bar = None
            if sendable >= _PROGRESS_MIN_RECORDS:  # a long outage: show the replay
                from tqdm import tqdm

                bar = tqdm(total=sendable, desc=f"replaying MLflow journal of run {self._run_id[:8]}", unit="record")
            while sendable:
                group = self._next_group(sendable)
                try:
                    self._send_group(group)
                except Exception as exc:  # noqa: BLE001 - any failure must leave training running
                    if _error_code(exc) not in _PERMANENT_ERRORS:
                        self._offline_until = time.monotonic() + self.retry_interval_s
                        log.warning("MLflow server %s unreachable (%s); %d records journaled in %s, retrying in "
                                    "%.0f s", self.shown_uri, redact_text(str(exc).splitlines()[0][:300]),
                                    len(self._pending), self.journal.path, self.retry_interval_s)
                        break
                    if len(group) > 1:  # find the bad record: resend this group one record at a time
                        self._single_records = len(group)
                        continue
                    self._reject(group[0], exc)
                self.journal.acknowledge(len(group))
                sendable -= len(group)
                self._single_records = max(0, self._single_records - len(group))
                if bar is not None:
                    bar.update(len(group))
            if bar is not None:
                bar.close()

    def _next_group(self, sendable: int) -> list[dict[str, Any]]:
        """Consecutive metric records among the first ``sendable`` that fit one log_batch call (a long
        replay takes few requests)."""
        first = self._pending[0]
        if first["kind"] != "metrics" or self._single_records:
            return [first]
        group, count = [first], len(first["metrics"])
        for record in self._pending[1:sendable]:
            if record["kind"] != "metrics" or count + len(record["metrics"]) > _METRICS_PER_BATCH:
                break
            group.append(record)
            count += len(record["metrics"])
        return group

    def _send_group(self, group: list[dict[str, Any]]) -> None:
        if len(group) == 1:
            self._send(group[0])
            return
        from mlflow.entities import Metric

        metrics = [Metric(k, v, r["timestamp"], r["step"]) for r in group for k, v in r["metrics"].items()]
        self.client.log_batch(self._run_id, metrics=metrics, synchronous=True)

    def _send(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        kind, run_id = record["kind"], self._run_id
        if kind == "metrics":
            items = [Metric(k, v, record["timestamp"], record["step"]) for k, v in record["metrics"].items()]
            for i in range(0, len(items), _METRICS_PER_BATCH):
                self.client.log_batch(run_id, metrics=items[i : i + _METRICS_PER_BATCH], synchronous=True)
        elif kind == "params":
            items = [Param(k, v) for k, v in record["params"].items()]
            for i in range(0, len(items), _PARAMS_PER_BATCH):
                self.client.log_batch(run_id, params=items[i : i + _PARAMS_PER_BATCH], synchronous=True)
        elif kind == "tags":
            items = [RunTag(k, v) for k, v in record["tags"].items()]
            for i in range(0, len(items), _TAGS_PER_BATCH):
                self.client.log_batch(run_id, tags=items[i : i + _TAGS_PER_BATCH], synchronous=True)
        elif kind == "table":
            self.client.log_table(run_id, data=record["data"], artifact_file=record["artifact_file"])
        elif kind == "artifact":
            path = Path(record["path"])
            if path.is_dir():
                target = f"{record['artifact_path']}/{path.name}" if record["artifact_path"] else path.name
                self.client.log_artifacts(run_id, str(path), target)
            else:
                self.client.log_artifact(run_id, str(path), record["artifact_path"])
        elif kind == "terminate":
            self.client.set_terminated(run_id, status=record["status"])
        else:
            raise ValueError(f"{self.journal.path}: unknown record kind {kind!r} (seq {record['seq']})")

    def _require_started(self) -> None:
        if self._run_id is None:
            raise RuntimeError("MlflowTracker: call start(params, tags) before logging")


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)
