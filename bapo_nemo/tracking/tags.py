"""Run tags that make a run reproducible and findable: git commit, config hash, container image, Slurm
job, host. Everything here reads the local environment only and never fails: a missing piece becomes
the tag value ``unknown`` rather than an exception in the middle of a launch."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bapo_nemo.tracking.redact import redact

UNKNOWN = "unknown"

# Env vars that name the container image. Our sbatch scripts export BAPO_CONTAINER_IMAGE; pyxis/enroot
# do not export the image name themselves, so the NGC build variables are the fallback.
_IMAGE_ENV_VARS = ("BAPO_CONTAINER_IMAGE", "CONTAINER_IMAGE", "SINGULARITY_CONTAINER", "APPTAINER_CONTAINER")
_NGC_BUILD_ENV_VARS = ("NVIDIA_BUILD_ID", "NVIDIA_PYTORCH_VERSION", "NEMO_RL_VERSION")
_SLURM_ENV_TAGS = {
    "SLURM_JOB_ID": "slurm.job_id",
    "SLURM_ARRAY_JOB_ID": "slurm.array_job_id",
    "SLURM_ARRAY_TASK_ID": "slurm.array_task_id",
    "SLURM_JOB_NAME": "slurm.job_name",
    "SLURM_JOB_NUM_NODES": "slurm.num_nodes",
    "SLURM_CLUSTER_NAME": "slurm.cluster",
    "SLURM_RESTART_COUNT": "slurm.restart_count",
}


def config_hash(config: Mapping[str, Any]) -> str:
    """Stable 16-hex-digit hash of a resolved config (key order does not matter)."""
    canonical = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def git_state(start: str | Path | None = None) -> tuple[str, bool | None]:
    """(commit, dirty) of the git checkout holding this package (or ``start``); env ``BAPO_GIT_COMMIT``
    wins, because the container copy of the package usually has no ``.git``."""
    if os.environ.get("BAPO_GIT_COMMIT"):
        return os.environ["BAPO_GIT_COMMIT"], None
    cwd = Path(start) if start else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                capture_output=True, text=True, timeout=5, check=True).stdout
        return commit, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN, None


def container_image() -> str:
    for var in _IMAGE_ENV_VARS:
        if os.environ.get(var):
            return os.environ[var]
    build = [f"{var}={os.environ[var]}" for var in _NGC_BUILD_ENV_VARS if os.environ.get(var)]
    return ",".join(build) if build else "none"


def default_tags(config_dict: Mapping[str, Any]) -> dict[str, str]:
    """Tags for a run of ``config_dict``: git commit (+ dirty flag), config hash, container image, Slurm
    job, host, versions. Secret-looking values are redacted like params."""
    from bapo_nemo import __version__ as bapo_version

    commit, dirty = git_state()
    tags = {
        "git.commit": commit,
        "mlflow.source.git.commit": commit,
        "config_hash": config_hash(config_dict),
        "container_image": container_image(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "bapo_nemo.version": str(bapo_version),
    }
    if dirty is not None:
        tags["git.dirty"] = str(dirty).lower()
    try:
        import torch

        tags["torch"] = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    for var, tag in _SLURM_ENV_TAGS.items():
        if os.environ.get(var):
            tags[tag] = os.environ[var]
    return redact(tags)
