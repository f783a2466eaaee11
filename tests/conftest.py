"""Shared test set-up: markers that skip with their reason where the hardware or software is absent."""

from __future__ import annotations

import importlib.util
import os

import pytest

from hypothesis import settings  # noqa: E402

# CI explores a fixed set of examples (the same on every run), so a landing never hinges on a random
# draw; developers' runs keep exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        return False


def _has_nemo_rl() -> bool:
    try:
        return importlib.util.find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: runs inside the NeMo-RL container on the cluster")
    skip_nemo = pytest.mark.skip(
        reason="needs NeMo-RL v0.7.0 (Python 3.13, not on PyPI): runs inside nvcr.io/nvidia/nemo-rl:v0.7.0"
    )
    cuda, nemo = _has_cuda(), _has_nemo_rl()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        if "nemo_rl" in item.keywords and not nemo:
            item.add_marker(skip_nemo)
