"""The tiny embedded run the CLI tests share: its config, `bapo-nemo` in a subprocess, and one finished
3-step run trained once per session (tests/conftest.py's `trained`), which each test copies before it
changes anything."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

TINY = {
    "grpo": {"seed": 0, "num_generations_per_prompt": 4, "num_prompts_per_step": 4, "max_num_steps": 3,
             "val_period": 10},
    "policy": {"train_micro_batch_size": 32},
    "partial_rollouts": {"token_budget": 12, "max_resumptions": 3, "max_response_tokens": 36,
                         "max_in_flight_groups": 8},
    "checkpointing": {"save_period": 1, "keep_top_k": 5},
    "runtime": {"progress": False},
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
              "max_position_embeddings": 96},
    "task": {"max_ops": 3, "eval_size": 8},
    "warmup": {"steps": 4, "batch_size": 8},
    "train": {"updates_per_batch": 1},
    "eval": {"k": 1},
    "tracking": {"samples_every": 10},
}


def bapo_nemo(*args: str, cwd: Path, timeout: float = HANG_GUARD_S, env: dict | None = None) -> subprocess.CompletedProcess:
    return cli_process.run(*args, cwd=cwd, env=cli_process.cli_env(env), timeout=timeout)


def write_config(directory: Path, data: dict | None = None, name: str = "tiny.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(TINY if data is None else data))
    return path


def with_(**sections) -> dict:
    """TINY with some keys replaced: with_(task={"train_file": "x"}) keeps the other task keys."""
    data = json.loads(json.dumps(TINY))
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return data


def train_tiny_run(root: Path) -> None:
    """Fills `root` with a finished 3-step run, root/run, with checkpoints step_0..step_3 (conftest's
    `trained` builds it once for all workers; each test copies it before changing it)."""
    done = bapo_nemo("train", str(write_config(root)), "--output-dir", "run", cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    (root / "stderr.txt").write_text(done.stderr)


TINY_RUN_KEY = hashlib.sha256(yaml.safe_dump(TINY).encode()).hexdigest()[:12]  # what the shared run depends on


def copy_run(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def tree_digest(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
