"""Registration of an export in the MLflow model registry: the HF directory is logged as artifacts of the
source training run (``hf_export/``, or ``hf_export_fp8/``) and a model version points at them, so a
registered version always leads back to the run, its metrics and its BAPO settings."""

from __future__ import annotations

import logging
from pathlib import Path

from bapo_nemo.export.hf import ExportResult

log = logging.getLogger(__name__)


def register_export(result: ExportResult, name: str, tracking_uri: str, artifact_path: str = "hf_export"):
    """Log ``result.out_dir`` to the source run and create a version of registered model ``name``."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from bapo_nemo.tracking.redact import redact_text
    from bapo_nemo.tracking.store import check_tracking_uri

    client = MlflowClient(tracking_uri=check_tracking_uri(tracking_uri), registry_uri=tracking_uri)
    run_id = result.run_id
    if run_id is None:
        raise ValueError(f"{result.source}: no MLflow run id recorded with the checkpoint, so the export cannot be "
                         "attached to its run; register it by hand or export a tracked checkpoint")
    try:
        client.get_run(run_id)
    except MlflowException as exc:
        raise ValueError(f"MLflow run {run_id} (from {result.source}) is not in {redact_text(tracking_uri)}: pass "
                         "--tracking-uri "
                         "with the store the run was tracked in") from exc
    client.log_artifacts(run_id, str(result.out_dir), artifact_path)
    if result.parity is not None:
        client.set_tag(run_id, f"bapo.{artifact_path}.parity_max_abs_diff", f"{result.parity.max_abs_diff:.6g}")
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
    tags = {"bapo.step": str(result.step), "bapo.source_checkpoint": str(Path(result.source))}
    if result.parity is not None:
        tags["bapo.parity_max_abs_diff"] = f"{result.parity.max_abs_diff:.6g}"
    version = client.create_model_version(name, source=source, run_id=run_id, tags=tags,
                                          description=f"BAPO export of step {result.step} of run {run_id}")
    log.info("registered %s version %s from %s", name, version.version, source)
    return version
