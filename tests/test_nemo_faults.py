"""The faults a 64-GPU job meets, injected into the CPU rehearsal of the cluster path.

`python -m bapo_nemo.train` on configs/bapo_32b_64k.yaml changed only in sizes (TP 1 x CP 1 x DP 2: faults
are about orchestration), through NeMo-RL's real Policy, Megatron worker methods, VllmGeneration over the
CPU stand-ins, real Ray, megatron-core dist_checkpointing and a real MLflow server. Six attempts of the same
command share one Ray head, one MLflow server and one checkpoint directory (a small tmpfs);
tests/nemo_fault_rehearsal_run.py lists them and the fault each meets, injected at a point reached by
construction (tests/nemo_faults.py).

After every fault: the run ends within the hang guard with one line naming what failed and the newest
complete checkpoint; the same command resumes from that checkpoint into the same MLflow run; at the end
every step is in MLflow exactly once; the in-flight partial rollouts come back from each checkpoint and
what an attempt generated after it is counted as regenerated.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_nemo_megatron_rehearsal import (
    PRESET,
    load_preset,
    rehearsal_assets,
    scaled_partial_rollouts,
    sized_overrides,
)

pytestmark = [pytest.mark.nemo_rl, pytest.mark.timeout(2700)]
RUN_GUARD_S = 2400
REPO = Path(__file__).resolve().parent.parent

LAYOUT = (1, 1, 2)  # TP, CP, DP
PROMPTS, GENERATIONS, GLOBAL_BATCH = 2, 4, 8  # one optimizer step, so one train() call, per GRPO step
SEQUENCE, RESPONSE_CAP, STEPS = 16, 8, 9
WORKER_LOST, DISK_FULL = 75, 74


def fault_config(root: Path, assets: dict) -> Path:
    preset = load_preset(PRESET)
    overrides = sized_overrides(root, assets, PRESET, layout=LAYOUT, prompts=PROMPTS, generations=GENERATIONS,
                                global_batch=GLOBAL_BATCH, sequence=SEQUENCE, response_cap=RESPONSE_CAP, steps=STEPS)
    overrides["partial_rollouts"] = scaled_partial_rollouts(
        preset["partial_rollouts"], preset["policy"]["generation"]["max_new_tokens"])
    overrides["checkpointing"].update(save_period=1, keep_top_k=20)  # every checkpoint kept: the test reads them
    overrides["policy"]["generation"]["vllm_cfg"] = {"tensor_parallel_size": 1}
    path = root / "bapo_32b_faults.yaml"
    path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    assets = rehearsal_assets(root)
    config = fault_config(root, assets)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"root": str(root), "config": str(config), "num_gpus": LAYOUT[0] * LAYOUT[1] * LAYOUT[2]}))
    log = root / "faults.log"
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "tests.nemo_fault_rehearsal_run", str(spec)], cwd=REPO,
                              stdout=out, stderr=subprocess.STDOUT, timeout=RUN_GUARD_S, check=False)
    assert done.returncode == 0, f"the fault rehearsal's process failed ({log}):\n{log.read_text()[-5000:]}"
    record = json.loads((root / "attempts.json").read_text())
    left = root / "checkpoints_left" if (root / "checkpoints_left").exists() else root / "checkpoints"
    return {**record, "root": root, "checkpoints": left, "by_name": {a["name"]: a for a in record["attempts"]}}


def the_error_line(attempt: dict) -> str:
    errors = [line for line in attempt["lines"] if line.startswith("error:")]
    assert len(errors) == 1, attempt
    return errors[0]


def test_the_attempts_end_as_each_fault_requires(faults):
    print(json.dumps(faults["attempts"], indent=1))
    assert [(a["name"], a["rc"]) for a in faults["attempts"]] == [
        ("policy worker killed", WORKER_LOST),
        ("generation worker killed", WORKER_LOST),
        ("mlflow outage, SIGUSR1 during a save", 0),
        ("driver killed", -9),
        ("damaged newest checkpoint, disk full", DISK_FULL),
        ("space freed", 0),
    ]


def test_a_killed_policy_worker_ends_the_run_with_one_line_naming_it_the_step_and_the_checkpoint(faults):
    attempt = faults["by_name"]["policy worker killed"]
    line = the_error_line(attempt)
    assert line.startswith("error: policy worker 1 of 2 on node 0 died during step 2 (pid ")
    assert f"newest complete checkpoint: {faults['root'] / 'checkpoints' / 'step_1'}." in line
    assert attempt["seconds"] < 600  # the hang guard (v0.7.0 waited for Ray's keep-alive otherwise)
