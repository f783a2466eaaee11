"""A run beside another (`bapo-nemo train ... --compare-with RUN_DIR`): the new run is tracked in the other
run's MLflow store and experiment, so `mlflow ui` and `bapo-nemo report` show both, and it reuses that run's
warm-up when the warm-up's inputs are the same (warmup.py). `compared_run` reads what the other run recorded:
its MLflow run (id, name, experiment) and the store it lives in (its own mlflow.db, or the store its
mlflow_store file names when it was itself tracked beside another)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bapo_nemo.tracking.redact import redact_text

EXAMPLE = "runs/local_cpu"


class CompareError(ValueError):
    """--compare-with names no usable run; the message says what to give instead."""


@dataclass(frozen=True)
class ComparedRun:
    output_dir: Path
    run_id: str
    run_name: str
    tracking_uri: str
    experiment_name: str


def compared_run(path: str | Path) -> ComparedRun:
    """The run of `bapo-nemo train --output-dir <path>`, as its files and MLflow store record it."""
    where = Path(path)
    if not where.is_dir():
        raise CompareError(f"--compare-with {path}: no such run directory: give the --output-dir of a "
                           f"`bapo-nemo train` run, e.g. --compare-with {EXAMPLE}")
    id_file = where / "mlflow_run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else ""
    if not run_id:
        raise CompareError(f"--compare-with {path}: not the output directory of a `bapo-nemo train` run (no "
                           f"mlflow_run_id in it): give one, e.g. --compare-with {EXAMPLE}")
    from mlflow.tracking import MlflowClient

    from bapo_nemo.embedded.run.resume import tracking_uri_for  # torch: only once a run is compared
    from bapo_nemo.tracking.store import sqlite_path

    uri = tracking_uri_for(None, where.resolve())  # as the run's own resume finds it

    store = sqlite_path(uri)
    if store is not None and not store.is_file():
        raise CompareError(f"--compare-with {path}: the MLflow store it was tracked in is not there (no {store}): "
                           "set logger.mlflow.tracking_uri to the store it was tracked in instead")
    try:
        client = MlflowClient(uri)
        run = client.get_run(run_id)
        experiment = client.get_experiment(run.info.experiment_id).name
    except Exception as exc:  # noqa: BLE001 - any client failure means the store cannot be read now
        raise CompareError(f"--compare-with {path}: cannot read its MLflow run {run_id} at {redact_text(uri)} "
                           f"({redact_text(str(exc).splitlines()[0][:200])})") from None
    return ComparedRun(where.resolve(), run_id, run.info.run_name or run_id, uri, experiment)


def tracking_overrides(compared: ComparedRun, configured_uri: str | None, overrides: list[str]) -> list[str]:
    """The settings that track a run beside `compared`: its store and experiment. A store or experiment the
    user chose too (in the config or on the command line) and that differs is a conflict."""
    chosen_names = [o.split("=", 1)[1] for o in overrides if o.startswith("logger.mlflow.experiment_name=")]
    if configured_uri is not None and configured_uri != compared.tracking_uri:
        raise CompareError(f"--compare-with {compared.output_dir} tracks this run in its store "
                           f"{redact_text(compared.tracking_uri)}, but logger.mlflow.tracking_uri="
                           f"{redact_text(configured_uri)} is set: drop one of the two")
    if chosen_names and chosen_names[-1] != compared.experiment_name:
        raise CompareError(f"--compare-with {compared.output_dir} tracks this run in its experiment "
                           f"{compared.experiment_name!r}, but logger.mlflow.experiment_name={chosen_names[-1]} is "
                           "set: drop one of the two")
    return [f"logger.mlflow.tracking_uri={json.dumps(compared.tracking_uri)}",
            f"logger.mlflow.experiment_name={json.dumps(compared.experiment_name)}"]
