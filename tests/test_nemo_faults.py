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
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.test_nemo_megatron_rehearsal import (
    PRESET,
    load_preset,
    policy_records,
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


def test_a_killed_generation_worker_ends_the_run_with_one_line_naming_it(faults):
    line = the_error_line(faults["by_name"]["generation worker killed"])
    assert re.match(r"error: generation worker [01] of 2 on node 0 died during step 3 \(pid \d+ ", line), line
    assert f"newest complete checkpoint: {faults['root'] / 'checkpoints' / 'step_2'}." in line


def test_sigusr1_while_a_checkpoint_is_written_lets_the_save_finish_and_stops_after_the_next_step(faults):
    """Policy worker 0 sends the driver SIGUSR1 from inside its save_checkpoint of step 5: the save completes
    (step_5 intact, never a tmp_ directory left visible as a step), the run goes on to the next step's
    checkpoint and stops there with NeMo-RL's early-stop line, exit 0."""
    from bapo_nemo.nemo.checkpoint_integrity import damage

    attempt = faults["by_name"]["mlflow outage, SIGUSR1 during a save"]
    fired = json.loads((faults["root"] / "fired_stop").read_text())
    assert fired["at"] == "policy.save_checkpoint" and fired["rank"] == 0
    assert "Timeout has been reached, stopping training early" in attempt["lines"]
    assert attempt["train_calls"] == 4  # steps 3-6: the signal came during step 5's save
    assert {"step_5", "step_6"} <= set(attempt["checkpoints"]) and "step_7" not in attempt["checkpoints"]
    assert not [c for c in attempt["checkpoints"] if c.startswith("tmp_")]
    for step in (5, 6):
        assert damage(faults["checkpoints"] / f"step_{step}") is None


def test_a_killed_driver_takes_its_workers_with_it_and_the_next_attempt_resumes(faults):
    attempt = faults["by_name"]["driver killed"]
    assert attempt["rc"] == -9 and "step_7" in attempt["checkpoints"]
    assert attempt["workers_gone_s"] < 120


def test_a_damaged_newest_checkpoint_is_named_skipped_and_kept(faults):
    """step_7's largest shard cut to half: the next attempt says so in one line, resumes from step_6, and
    the damaged checkpoint's bytes survive the run's save of step 7 under a name NeMo-RL never reads."""
    damaged = faults["damaged"]
    attempt = faults["by_name"]["damaged newest checkpoint, disk full"]
    shard = Path(damaged["shard"]).relative_to(damaged["checkpoint"])
    skipped, moved = [x for x in attempt["lines"] if "is damaged" in x]
    assert f"moved to {faults['root'] / 'checkpoints' / 'damaged_step_7'} before the checkpoint of step 7" in moved
    line = skipped
    assert line.startswith(f"checkpoint {damaged['checkpoint']} is damaged ({shard} is truncated")
    assert line.endswith(f"skipped and left in place; resuming from {faults['root'] / 'checkpoints' / 'step_6'}")
    kept = faults["checkpoints"] / "damaged_step_7" / shard
    assert kept.stat().st_size == damaged["size"] // 2


def test_a_full_disk_fails_the_save_with_one_line_and_the_previous_checkpoint_stays_usable(faults):
    """The checkpoint tmpfs filled during step 8: its save fails, the run ends with one line naming the
    step, the unfinished directory and the newest complete checkpoint (step 7, saved again by this
    attempt); nothing half-written is a step_N; the same command resumes from step 7 once space is freed."""
    if faults["tmpfs"] != "mounted":
        pytest.skip(f"no tmpfs for the checkpoint directory: mount {faults['tmpfs']}")
    full = faults["by_name"]["damaged newest checkpoint, disk full"]
    line = the_error_line(full)
    checkpoints = faults["root"] / "checkpoints"
    assert line.startswith(f"error: the checkpoint save of step 8 failed: no space left on device under {checkpoints}")
    assert f"newest complete checkpoint: {checkpoints / 'step_7'}." in line
    assert "step_8" not in full["checkpoints"]
    freed = faults["by_name"]["space freed"]
    assert freed["train_calls"] == 2 and "step_9" in freed["checkpoints"]


def resumes(records: list[dict]) -> list[tuple[int, dict, dict]]:
    """(step, the params a worker loaded, the params that rank last saved for that step) per resume."""
    saved, out = {}, []
    for record in records:
        if record["kind"] == "save":
            saved[int(re.search(r"tmp_step_(\d+)", record["weights_path"]).group(1))] = record
        elif record["kind"] == "init" and record["weights_path"] is not None:
            step = int(re.search(r"step_(\d+)", record["weights_path"]).group(1))
            out.append((step, record, saved[step]))
    return out


def test_every_resume_starts_from_exactly_what_its_checkpoint_saved(faults):
    """Nothing a complete checkpoint held is lost: each attempt's workers load the weights and Adam moments
    their rank saved into the checkpoint it resumed from (step 1, 2, 6, 6 past the damaged 7, 7)."""
    records = policy_records(faults["root"] / "record")
    for rank, recs in records.items():
        loaded = resumes(recs)
        assert [step for step, _, _ in loaded] == [1, 2, 6, 6, 7], rank
        for step, init, save in loaded:
            for name, value in save["params"].items():
                assert torch.equal(init["params"][name], value), (rank, step, name)
            for a, b in zip(save["optimizer"]["moments"], init["optimizer"]["moments"], strict=True):
                assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a), (rank, step)


def test_every_step_is_in_the_one_mlflow_run_exactly_once(faults):
    """Six attempts, a server outage, steps lost and run again: one MLflow run, every step of every train
    metric logged once (steps a dead attempt logged past its checkpoint were set aside, not sent)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{faults['root'] / 'mlflow' / 'server.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rehearsal").experiment_id])
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/bapo/c_high", "train/reward"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(1, STEPS + 1)), (key, steps)
    outage = faults["outage"]
    assert outage["up_at"] > outage["down_at"]
    # kept, not sent: step 2 as the first attempt logged it before dying, step 7 as the attempt that skipped
    # the damaged step_7 ran it again (the damaged checkpoint's step 7 had been sent)
    (superseded,) = (faults["checkpoints"] / "mlflow_journal").glob("*.superseded.jsonl")
    kept = {json.loads(line)["step"] for line in superseded.read_text().splitlines()}
    assert {2, 7} <= kept, kept


def test_what_an_attempt_generated_after_its_checkpoint_is_counted_as_regenerated(faults):
    """The partial-rollout ledger: each attempt that resumes says how many tokens the attempt before it
    generated after the checkpoint it resumes from."""
    counted = {a["name"]: [x for x in a["lines"] if "generated again" in x] for a in faults["attempts"]}
    assert counted["policy worker killed"] == []
    # after a death in step 2's training: step 2's rollout is generated again; after the driver's death in
    # step 8 and the damaged step_7: steps 7 and 8's
    for name, since in (("generation worker killed", 1), ("damaged newest checkpoint, disk full", 6),
                        ("space freed", 7)):
        (line,) = counted[name]
        assert re.match(rf"resumed from step_{since}: [1-9]\d* tokens in [1-9]\d* segments", line), (name, line)
    # the generation worker died mid-batch: the driver never received that batch, so nothing to count
    (line,) = counted["mlflow outage, SIGUSR1 during a save"]
    assert line.startswith("resumed from step_2: 0 tokens in 0 segments"), line
