"""Where MLflow runs are stored: which tracking URIs are accepted, the sqlite file behind one and its
creation lock, a server's HTTP settings. Shared by the trackers, the report and the export."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from bapo_nemo.tracking.redact import redact_text

# Short HTTP timeouts so a dead tracking server costs seconds, not MLflow's default ~4 minutes of
# retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES=7, MLFLOW_HTTP_REQUEST_TIMEOUT=120 in mlflow 3.x). Only set
# when the user has not chosen values; the journal makes retries inside MLflow unnecessary.
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}

class TrackingConfigError(ValueError):
    """The tracking URI or experiment cannot be used; the message says what to use instead."""


class TrackingUnavailableError(RuntimeError):
    """A new run could not be created because the tracking server is unreachable."""


def check_tracking_uri(tracking_uri: str) -> str:
    """Accept ``sqlite:///path.db``, ``http(s)://host:port``, ``databricks``/``postgresql``/``mysql``; refuse a
    plain file store: metric names such as ``reward/mean`` become nested paths there and MLflow 3 refuses
    it by default. For a URI with a password, MLflow's printing of run URLs is turned off."""
    if not tracking_uri or not isinstance(tracking_uri, str):
        raise TrackingConfigError("tracking_uri is empty: use sqlite:///<dir>/mlflow.db or http://<host>:<port>")
    scheme = urlparse(tracking_uri).scheme
    if scheme in ("", "file") or (len(scheme) == 1 and tracking_uri[1:3] == ":\\"):
        raise TrackingConfigError(
            f"tracking_uri {redact_text(tracking_uri)!r} is a plain file store, which breaks on metric names containing "
            "'/' (e.g. reward/mean) and is refused by MLflow 3: use sqlite:///<dir>/mlflow.db (no server "
            "needed) or the URL of an MLflow server, e.g. http://127.0.0.1:5000"
        )
    if scheme == "sqlite" and not tracking_uri.startswith("sqlite:///"):
        raise TrackingConfigError(f"tracking_uri {redact_text(tracking_uri)!r}: write sqlite URIs as "
                                  "sqlite:///<path>.db")
    if redact_text(tracking_uri) != tracking_uri:  # MLflow prints "View run ... at: <URL with the password>"
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    return tracking_uri


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, else None."""
    return Path(tracking_uri[len("sqlite:///"):]).expanduser() if tracking_uri.startswith("sqlite:///") else None


@contextmanager
def store_lock(tracking_uri: str) -> Iterator[None]:
    """Hold an exclusive flock on ``<db>.lock`` beside a sqlite store (nothing for a server). MLflow creates
    a new store's tables and runs its schema migrations in whichever process opens the file first; two
    doing it at once can leave it half-migrated for every later run, so they take turns here."""
    db = sqlite_path(tracking_uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def is_remote(tracking_uri: str) -> bool:
    return urlparse(tracking_uri).scheme in ("http", "https", "databricks")


def sqlite_artifact_root(tracking_uri: str, experiment_name: str) -> str | None:
    """Without a server, MLflow puts artifacts in ./mlruns of whatever the cwd is: keep them next to the db."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db_path = Path(tracking_uri[len("sqlite:///"):]).expanduser().resolve()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment_name)
    return (db_path.parent / "mlartifacts" / safe).as_uri()
