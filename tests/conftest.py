"""Shared test set-up: markers that skip with their reason where the hardware or software is absent."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import settings

# CI explores a fixed set of examples (the same on every run), so a landing never hinges on a random
# draw; developers' runs keep exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# NeMo-RL from source (NEMO_RL_SRC, set by .ci/run): the shim aliases typing.TypedDict/NotRequired and
# puts the source on sys.path. Run it here for this process, and put its folder (and this checkout) on
# PYTHONPATH so every subprocess and Ray worker the tests start runs it at start-up too.
_SHIM_DIR = Path(__file__).parent / "nemo_rl_shim"
_REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_nemo_rl_shim", _SHIM_DIR / "sitecustomize.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
if os.environ.get("NEMO_RL_SRC"):
    _paths = [str(_SHIM_DIR), str(_REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(_paths))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001  # pragma: no cover - torch is a hard dependency
        return False


def _has_nemo_rl() -> bool:
    """An installed nemo_rl (the container) or a source checkout in NEMO_RL_SRC (CI: .ci/run sets it)."""
    try:
        return importlib.util.find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: runs inside the NeMo-RL container on the cluster")
    skip_nemo = pytest.mark.skip(
        reason="needs NeMo-RL v0.7.0: an installed nemo_rl (nvcr.io/nvidia/nemo-rl:v0.7.0) or its source in "
        "NEMO_RL_SRC with the `nemo-cpu` extra installed (.ci/run sets it when ../shared/upstream/nemo-rl-v0.7.0 exists)"
    )
    cuda, nemo = _has_cuda(), _has_nemo_rl()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        if "nemo_rl" in item.keywords and not nemo:
            item.add_marker(skip_nemo)



@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """A finished 3-step tiny run, shared by the user-error tests (each copies it before changing it)."""
    from test_user_errors import train_tiny_run

    return train_tiny_run(tmp_path_factory.mktemp("trained"))
