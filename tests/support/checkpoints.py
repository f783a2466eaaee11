"""Checkpoints to damage: one real 2-rank megatron-core save (torch_dist on gloo, written by
tests/support/megatron_checkpoint_writer.py), step_N directories as NeMo-RL leaves them, and a real small
tmpfs to fill (the checkpoint-integrity tests, with NeMo-RL and without)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo_nemo.nemo.partial_rollout import STATE_FILE

REPO = Path(__file__).resolve().parents[2]


WEIGHTS = Path("policy/weights/iter_0000000")


def write_step(step_dir: Path, weights_template: Path, step: int) -> None:
    """A step_N as NeMo-RL leaves it, with our partial-rollout file and the real Megatron weights."""
    shutil.copytree(weights_template, step_dir / "policy" / "weights")
    (step_dir / "training_info.json").write_text(json.dumps({"current_step": step, "total_steps": step}))
    (step_dir / "config.yaml").write_text("grpo:\n  max_num_steps: 10\n")
    (step_dir / STATE_FILE).write_text(json.dumps({"format_version": 1, "manager": {"in_flight": [[1, 2, 3]] * 50}}))
    torch.save({"sampler": list(range(100))}, step_dir / "train_dataloader.pt")


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """policy/weights of one real 2-rank megatron-core save (Megatron-Bridge layout)."""
    root = tmp_path_factory.mktemp("megatron")
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.megatron_checkpoint_writer", str(root / "weights" / WEIGHTS.name), "2", "1000",
         str(root / "report")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[-1]) == [], done.stderr[-3000:]
    return root / "weights"


def largest_shard(step_dir: Path) -> Path:
    return max((step_dir / WEIGHTS).glob("*.distcp"), key=lambda p: (p.stat().st_size, p.name))


def truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 256 KiB tmpfs (mount needs root; skipped, saying why, where it is refused)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (mount refused: {done.stderr.strip() or done.returncode})")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # lazy: a failed write may hold a file open
