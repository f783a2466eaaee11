"""The 32B preset's training path rehearsed on CPU: `python -m bapo_nemo.train` (its `main()`) on
configs/bapo_32b_64k.yaml (bapo_32b.yaml plus partial rollouts) changed only in sizes, TP 2 x CP 2 x DP 2
on gloo, through NeMo-RL v0.7.0's real `Policy` -> `RayWorkerGroup` -> `MegatronPolicyWorker` methods and
the real `VllmGeneration`.

Stand-ins, each at the boundary of what cannot run here (details in their modules and docs/nemo_rl.md):
- the policy worker's `__init__` (GPU set-up, Megatron-Bridge, GPTModel with TE layers): a CPU version
  building a tiny model from megatron-core's tensor-parallel layers, wrapped in megatron-core's real DDP
  and distributed optimizer (tests/support/nemo_megatron_standins.py), entered through the upstream seam
  `Policy(worker_extension_cls_fqn=...)`;
- vLLM's generation worker: tiny-LM sampling behind `VllmGenerationWorker`'s methods
  (tests/support/nemo_vllm_standins.py);
- CUDA calls, Megatron-Bridge's few helpers, megatron-core 0.16.1's gaps (tests/support/nemo_rl_shim/megatron_cpu.py).

One module-scoped run drives everything (one driver run of two GRPO steps in a process of its own,
tests/support/nemo_megatron_rehearsal_run.py); the workers record, per rank, what the loss saw and the reduced
gradients, and the tests compare them with independent computations. Stopping and resuming are rehearsed
where that is the subject: tests/nemo_rl/test_fault_rehearsal.py (DP 2, four resumes after five faults) and
tests/nemo_rl/test_async_rehearsal.py (the async loop, on the real engine); this module checks the checkpoint the workers
write. The negative controls plant defects into the same worker code on 8 gloo ranks without Ray
(tests/support/nemo_megatron_harness.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.hang_guard import HANG_GUARD_S
from tests.support.nemo_rehearsal import (
    REPO,
    async_checkpoint_saves,
    at,
    bapo_options,
    check_bounds_of_every_step,
    grads_of,
    load_preset,
    of_kind,
    optimizer_steps,
    policy_records,
    reference_logprobs,
    rehearsal_assets,
    run_rehearsal,
    scaled_partial_rollouts,
    search_over,
    sized_overrides,
    weights_of,
)

# Runs in an xdist worker of its own (tests/conftest.py's "nemo-rl-megatron" group: 17 Ray actors and ~9 GB
# at the peak, so never beside a second copy). The module fixture's work is fixed (one driver run, 16 Ray
# workers started) and its wall time follows the machine's load; the limits here are for hangs only, the
# driver process's below pytest-timeout's so that a hang fails with the driver's log.
pytestmark = pytest.mark.timeout(4800)  # with the wait for the rehearsal slot (the other rehearsals of both trees)
RUN_GUARD_S = 2400

# bapo_32b.yaml's 64k variant: bapo_32b.yaml with every block it ships (Megatron, packing with fuse_loss,
# FP8, the BAPO block, importance sampling, the ratio reference) plus the partial-rollout block the 32B
# presets ship (the one with the most segments and prompts in flight); everything else it changes is sizes.
PRESET = REPO / "configs" / "bapo_32b_64k.yaml"
# The presets a cluster job runs: every NeMo-RL config under configs/ (the embedded ones have no policy:).
KNOWN_PRESETS = {"bapo_7b.yaml", "bapo_32b.yaml", "bapo_32b_64k.yaml", "bapo_32b_partial.yaml"}

# The sizes the rehearsal changes, and nothing else (see rehearsal_config): 8 logical GPUs as TP 2 x CP 2 x
# DP 2; 8 prompts x 4 samples = 32 responses per step, trained as 4 optimizer steps of 8 (the preset's 4
# steps per rollout batch), so every DP rank packs 4 responses into 16-token bins: 2+ micro-batches each.
TP, CP, DP = 2, 2, 2
PROMPTS, GENERATIONS, GLOBAL_BATCH = 8, 4, 8
SEQUENCE, RESPONSE_CAP = 16, 8
STEPS = 2

# The modes the rehearsal runs (test_the_shipped_presets_use_only_rehearsed_modes checks the presets
# against this, and test_the_rehearsal_runs_the_presets_modes checks that the rehearsal's own config has
# exactly these).
REHEARSED_MODES = {
    "backend": {"megatron"},
    "granularity": {"step"},
    "ratio_reference": {"behavior"},
    "measure": {"gradient"},
    "order": {"paper"},
    "sequence_packing": {True},
    "fuse_loss": {True},
    "context_parallel": {True},
    "sequence_parallel": {True},
    "fp8_packing_pad": {True},
    "importance_sampling_correction": {True},
    "truncated_importance_sampling": {None},
    "dual_clip": {None},
    "async_grpo": {False},
    "generation_colocated": {True},
    "step_bounds": {"exact"},
    "partial_rollouts": {"keep"},
    "partial_prefill": {True},
}
# The one mode a shipped preset uses that the rehearsal does not run: no partial rollouts (bapo_7b.yaml,
# bapo_32b.yaml). Without the block grpo_train calls upstream's own run_multi_turn_rollout; the training
# path below it (Policy, the Megatron workers, the loss) is the same one the rehearsal runs, and
# tests/nemo_rl/test_driver_e2e.py runs that rollout path on CPU.
NOT_REHEARSED_HERE = {"partial_rollouts": {None}, "partial_prefill": {None}}
# loss_fn.bapo keys the rehearsal knows; a new option (e.g. a cheaper way to get step-wide bounds) in a
# preset is a mode the rehearsal does not run yet.
KNOWN_BAPO_KEYS = {
    "enabled", "rho0", "c_low_min", "c_low_max", "c_low_step", "c_high_min", "c_high_max", "c_high_step",
    "order", "measure", "dual_clip", "granularity", "ratio_reference", "nonfinite", "step_bounds_sample",
}
KNOWN_PARTIAL_ROLLOUT_KEYS = {
    "token_budget", "max_resumptions", "max_response_tokens", "global_token_budget", "max_in_flight_groups",
    "prompts_per_iteration", "stale_segments", "stale_weight_decay", "prefill_batches",
}


# ---- configs and modes -------------------------------------------------------------------------------
def modes(config: dict) -> dict:
    """The configuration choices that select code paths (not sizes)."""
    policy, loss = config["policy"], config["loss_fn"]
    bapo = loss.get("bapo") or {}
    megatron = policy.get("megatron_cfg") or {}
    from bapo_nemo.nemo.packing import fp8_packed_multiple

    partial = config.get("partial_rollouts")
    sample = float(bapo.get("step_bounds_sample", 1.0))
    return {
        "backend": "megatron" if megatron.get("enabled") else "dtensor",
        "granularity": bapo.get("granularity", "microbatch"),
        "ratio_reference": bapo.get("ratio_reference", "behavior"),
        "measure": bapo.get("measure"),
        "order": bapo.get("order"),
        "sequence_packing": bool(policy["sequence_packing"]["enabled"]),
        "fuse_loss": bool(policy["sequence_packing"].get("fuse_loss")),
        "context_parallel": int(megatron.get("context_parallel_size", 1)) > 1,
        "sequence_parallel": bool(megatron.get("sequence_parallel")),
        "fp8_packing_pad": fp8_packed_multiple(policy) > 1,
        "importance_sampling_correction": bool(loss.get("use_importance_sampling_correction")),
        "truncated_importance_sampling": loss.get("truncated_importance_sampling_type"),
        "dual_clip": bapo.get("dual_clip", loss.get("ratio_clip_c")),
        "async_grpo": bool((config["grpo"].get("async_grpo") or {}).get("enabled")),
        "generation_colocated": bool(policy["generation"]["colocated"]["enabled"]),
        # granularity step's extra log-prob pass: over the whole step (1), a sample of its groups, or none
        "step_bounds": "exact" if sample == 1.0 else "prev_logprobs" if sample == 0.0 else "sampled",
        "partial_rollouts": None if partial is None else partial.get("stale_segments", "keep"),
        # the driver's pool: batches of prompts in flight beyond the step's (driver default 1)
        "partial_prefill": None if partial is None else int(partial.get("prefill_batches", 1)) > 0,
    }


def shipped_presets() -> list[Path]:
    """Every cluster preset under configs/: a NeMo-RL config by `bapo_nemo.config_kind` (the embedded
    configs share NeMo-RL's section names, `policy:` included, so a section name alone does not tell)."""
    from bapo_nemo.config_kind import config_kind

    return [
        path
        for path in sorted((REPO / "configs").glob("*.yaml"))
        if config_kind(yaml.safe_load(path.read_text()) or {}) == "nemo_rl"
    ]


def rehearsal_config(root: Path, assets: dict) -> tuple[Path, dict]:
    """The preset (configs/bapo_32b_64k.yaml) with sizes only changed (sized_overrides), its partial-rollout
    block scaled to them."""
    preset = load_preset(PRESET)
    assert preset.get("partial_rollouts"), f"{PRESET.name} ships no partial_rollouts block to rehearse"
    partial = scaled_partial_rollouts(preset, response_cap=RESPONSE_CAP, prompts=PROMPTS, generations=GENERATIONS)
    overrides = sized_overrides(
        root, assets, PRESET, layout=(TP, CP, DP), prompts=PROMPTS, generations=GENERATIONS,
        global_batch=GLOBAL_BATCH, sequence=SEQUENCE, response_cap=RESPONSE_CAP, steps=STEPS,
    )
    overrides["partial_rollouts"] = partial
    path = root / "bapo_32b_rehearsal.yaml"
    path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    return path, {"partial_rollouts": partial}


def unrehearsed(config: dict) -> list[str]:
    """What in a NeMo-RL config selects a code path the CPU rehearsal does not run (empty: all rehearsed)."""
    problems = []
    for mode, value in modes(config).items():
        if value not in REHEARSED_MODES[mode] and value not in NOT_REHEARSED_HERE.get(mode, ()):
            problems.append(f"{mode}={value!r} (the rehearsal runs {sorted(map(str, REHEARSED_MODES[mode]))})")
    for block, known in (("loss_fn.bapo", KNOWN_BAPO_KEYS), ("partial_rollouts", KNOWN_PARTIAL_ROLLOUT_KEYS)):
        section = config
        for key in block.split("."):
            section = (section or {}).get(key)
        problems += [f"{block}.{key} (an option the rehearsal does not know)" for key in sorted(set(section or {}) - known)]
    return problems


def test_the_shipped_presets_use_only_rehearsed_modes():
    """Every mode the cluster presets select is one the CPU rehearsal runs (granularity, ratio reference,
    step_bounds_sample, packing and fuse_loss, CP, sequence parallel, FP8 packing, importance sampling,
    async, partial rollouts with their staleness rule and prefill pool, no unknown BAPO or partial-rollout
    option): a preset that gains another fails here, naming it, until the rehearsal covers it. The check
    itself flags a planted change of each kind."""
    presets = shipped_presets()
    assert {p.name for p in presets} >= KNOWN_PRESETS, [p.name for p in presets]
    problems = {p.name: unrehearsed(load_preset(p)) for p in presets}
    assert not any(problems.values()), "not rehearsed on CPU (tests/nemo_rl/test_megatron_rehearsal.py):\n" + "\n".join(
        f"configs/{name}: {problem}" for name, found in problems.items() for problem in found
    )
    planted = load_preset(PRESET)
    planted["loss_fn"]["bapo"]["step_bounds_sample"] = 0.25
    planted["partial_rollouts"].update(stale_segments="exclude", prefill_batches=0, new_option=1)
    planted["policy"]["megatron_cfg"]["context_parallel_size"] = 1
    assert unrehearsed(planted) == [
        "context_parallel=False (the rehearsal runs ['True'])",
        "step_bounds='sampled' (the rehearsal runs ['exact'])",
        "partial_rollouts='exclude' (the rehearsal runs ['keep'])",
        "partial_prefill=False (the rehearsal runs ['True'])",
        "partial_rollouts.new_option (an option the rehearsal does not know)",
    ]


def test_the_rehearsal_config_changes_only_sizes(tmp_path):
    """The rehearsal's config selects exactly the modes of the preset it rehearses (REHEARSED_MODES is
    what it runs, not a wish list)."""
    path, _ = rehearsal_config(tmp_path, {"model": tmp_path, "train": tmp_path / "x.jsonl", "mlflow": "sqlite://"})
    preset, rehearsal = modes(load_preset(PRESET)), modes(load_preset(path))
    assert rehearsal == preset
    assert {k: {v} for k, v in rehearsal.items()} == REHEARSED_MODES


# ---- the run ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The driver run (in a process of its own: tests/support/nemo_megatron_rehearsal_run.py says why); returns
    where everything was recorded."""
    root = tmp_path_factory.mktemp("rehearsal")
    assets = rehearsal_assets(root, sequence=SEQUENCE)
    config, info = rehearsal_config(root, assets)
    spec = {"num_gpus": TP * CP * DP, "slots": 2}  # ~9 GB at its peak: alone on the machine
    return run_rehearsal(root, assets, config, info, spec, RUN_GUARD_S)


@pytest.mark.slow  # shares the module's rehearsal run (minutes on two cores)
def test_the_run_finishes(rehearsal):
    assert [r["rc"] for r in rehearsal["runs"]] == [0], rehearsal["runs"]


# ---- reading the records back ----------------------------------------------------------------------------
def reference_loss_and_grads(weights: dict, batches: list, loss_cfg: dict, global_valid_toks: float):
    """BAPOLossFn in one process over `batches` (each carrying the bounds it must use, as per-sample step
    keys) at `weights`: the summed loss and d(loss)/d(weights)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from bapo_nemo.nemo.loss import BAPOLossFn

    cfg = json.loads(json.dumps(loss_cfg))
    cfg["bapo"]["granularity"] = "step"  # the bounds are given
    loss_fn = BAPOLossFn(cfg)
    params = {k: v.detach().clone().double().requires_grad_(True) for k, v in weights.items()}
    total = 0.0
    for batch in batches:
        data = BatchedDataDict({k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()
                                if isinstance(v, torch.Tensor)})
        lp = reference_logprobs(params, data)
        loss, _ = loss_fn(
            next_token_logprobs=lp[:, 1:], data=data,
            global_valid_seqs=torch.tensor(float(data["sample_mask"].sum())),
            global_valid_toks=torch.tensor(float(global_valid_toks)),
        )
        total = total + loss
    total.backward()
    return float(total.detach()), {k: p.grad.float() for k, p in params.items()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


# ---- what the loss saw, per optimizer step ------------------------------------------------------------
@pytest.mark.slow  # shares the module's rehearsal run (minutes on two cores)
def test_the_bounds_of_every_optimizer_step_are_the_search_over_that_steps_tokens(rehearsal):
    """granularity: step. For every optimizer step (2 GRPO steps x 4): the bounds every
    loss call on every rank clipped with equal search_clip_bounds over the whole step's tokens, computed
    here from the step's batch and the policy's log-probs at the weights before that step (the one-process
    tiny LM on the weights the workers held), independently of the driver's search and NeMo-RL's passes."""
    steps = optimizer_steps(rehearsal)
    assert len(steps) == STEPS * PROMPTS * GENERATIONS // GLOBAL_BATCH
    check_bounds_of_every_step(steps, bapo_options(rehearsal["config"]))


@pytest.mark.slow  # shares the module's rehearsal run (minutes on two cores)
def test_loss_and_gradients_equal_a_single_process_reference(rehearsal):
    """For every optimizer step with 2+ packed micro-batches on each DP rank: the loss the 8 ranks
    computed (summed over micro-batches and DP ranks; every TP/CP peer reports the same) and the gradients
    megatron-core reduced over DP x CP equal BAPOLossFn and autograd in one process on the whole global
    batch at the same weights."""
    steps = optimizer_steps(rehearsal)
    compared = 0
    for step in steps:
        leaders = {r: rec for r, rec in step["ranks"].items() if rec["coords"]["tp"] == 0 and rec["coords"]["cp"] == 0}
        if min(len(rec["loss_calls"]) for rec in leaders.values()) < 2:
            continue
        compared += 1
        # every DP and CP replica holds the same reduced gradient for its TP shard
        for rank, recs in step["records"].items():
            mine = of_kind(recs, "grads")[step["index"]]["grads"]
            (leader,) = at(step["records"], dp=0, cp=0, tp=recs[0]["coords"]["tp"])
            theirs = of_kind(leader, "grads")[step["index"]]["grads"]
            assert all(torch.equal(mine[n], theirs[n]) for n in mine), f"rank {rank}'s reduced gradient"
        check_step_against_reference([step["batch"]], step["ranks"], step["weights"], step["grads"],
                                     rehearsal["config"]["loss_fn"])
    assert compared >= 1, "no optimizer step had several micro-batches per DP rank"


def check_step_against_reference(batches, ranks, weights, reduced_grads, loss_cfg, rel=1e-5) -> None:
    """The comparison itself (also run on the negative controls, where it must fail): `batches` cover the
    optimizer step's samples once, each with the bounds its tokens must be clipped with (step keys)."""
    global_toks = sum(float((b["token_mask"][:, 1:] * b["sample_mask"].unsqueeze(-1)).sum()) for b in batches)
    expected_loss, expected_grads = reference_loss_and_grads(weights, batches, loss_cfg, global_toks)
    by_replica = defaultdict(list)
    for record in ranks.values():
        c = record["coords"]
        by_replica[(c["tp"], c["cp"])].append(sum(call["loss"] for call in record["loss_calls"]))
        for call in record["loss_calls"]:
            assert call["global_valid_toks"] == global_toks
    for replica, losses in by_replica.items():
        assert sum(losses) == pytest.approx(expected_loss, rel=rel), f"loss of TP/CP replica {replica}"
    for name, grad in expected_grads.items():
        err = relative_error(reduced_grads[name], grad)
        assert err < rel * 10, f"gradient of {name}: relative error {err:.2e}"


@pytest.mark.slow  # shares the module's rehearsal run (minutes on two cores)
def test_step_granularity_extra_logprob_passes_and_its_keys_survive_the_packing_reorder(rehearsal):
    """granularity: step costs one extra log-prob pass per optimizer step after the first of a rollout
    batch. Those passes go through NeMo-RL's real Policy.get_logprobs (sharded by DP with the packing
    reorder undone) and return the current policy's log-probs: the tiny LM's at the weights before that
    step. The per-sample bound keys StepBoundsTrainer attaches reach every loss call intact: each row the
    loss saw is one row of the driver's batch with every column equal (after shard_by_batch_size
    reordered the rows into bins), and each row of the batch reaches exactly one DP rank."""
    steps = optimizer_steps(rehearsal)
    per_rollout = PROMPTS * GENERATIONS // GLOBAL_BATCH
    # The driver's get_logprobs calls: per GRPO step, grpo_train's prev_logprobs pass over the rollout
    # batch, then the extra passes over optimizer steps 2..4 (and, at each checkpoint, the parity
    # recorder's pass over a few of its sequences).
    logprob_calls = rehearsal["calls"]["get_logprobs"]
    assert sum(data.size == PROMPTS * GENERATIONS for data, _ in logprob_calls) == STEPS
    extra = [(data, result) for data, result in logprob_calls if data.size == GLOBAL_BATCH]
    assert len(extra) == STEPS * (per_rollout - 1)
    for n, (data, result) in enumerate(extra):
        k = (n // (per_rollout - 1)) * per_rollout + n % (per_rollout - 1) + 1  # optimizer steps 2..4
        want = reference_logprobs(steps[k]["weights"], data)
        mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
        assert relative_error(result["logprobs"] * mask, want * mask) < 1e-4, f"extra pass {n}"
    # Every rank's worker ran each of those passes on its DP shard.
    records = policy_records(rehearsal["record"])
    for rank, recs in records.items():
        assert len(of_kind(recs, "logprobs")) == len(logprob_calls), rank

    reordered = 0
    for step in steps:
        batch = step["batch"]
        rows = defaultdict(list)  # identical samples (same prompt, same response) are interchangeable
        for i in range(batch.size):
            rows[_row_key(batch, i)].append(i)
        seen = []
        leaders_pool = {key: list(indices) for key, indices in rows.items()}  # DP shards: each row once
        for rank, record in step["ranks"].items():
            leader = record["coords"]["tp"] == 0 and record["coords"]["cp"] == 0
            unused = leaders_pool if leader else {key: list(indices) for key, indices in rows.items()}
            order = []
            for call in record["loss_calls"]:
                data = call["data"]
                for j in range(data["input_ids"].shape[0]):
                    candidates = unused[_row_key(data, j)]
                    match = [i for i in candidates if _same_row(data, j, batch, i)]
                    assert match, f"step {step['index']} rank {rank}: a loss row is no row of the batch"
                    candidates.remove(match[0])
                    order.append(match[0])
            if leader:
                seen += order
                reordered += order != sorted(order)
        assert sorted(seen) == list(range(batch.size)), f"step {step['index']}: rows lost or doubled"
    assert reordered >= 1, "packing never reordered a batch: the test would not see a reorder bug"


ROW_COLUMNS = ("advantages", "generation_logprobs", "prev_logprobs", "token_mask")


def _same_row(data, j: int, batch, i: int) -> bool:
    """Row j of the loss's data is row i of the driver's batch: every per-sample column equal (the step
    bounds included), every per-token column equal over the sequence (past its length, the log-prob
    passes leave values of padding tokens)."""
    from bapo_nemo.nemo.step_bounds import STEP_BOUNDS_KEYS

    n = int(data["input_lengths"][j])
    if int(batch["input_lengths"][i]) != n or not torch.equal(data["input_ids"][j, :n], batch["input_ids"][i, :n]):
        return False
    if not all(torch.equal(data[k][j], batch[k][i]) for k in (*STEP_BOUNDS_KEYS, "sample_mask")):
        return False
    return all(torch.equal(data[k][j, :n], batch[k][i, :n]) for k in ROW_COLUMNS)


def _row_key(data, j: int) -> tuple:
    n = int(data["input_lengths"][j])
    return tuple(data["input_ids"][j, :n].tolist()), tuple(data["generation_logprobs"][j, :n].tolist())


def generation_segments(record_dir: Path) -> list[dict]:
    segments = []
    for path in sorted((record_dir / "generation").glob("*.jsonl")):
        segments += [json.loads(line) for line in path.read_text().splitlines()]
    return segments


@pytest.mark.slow  # shares the module's rehearsal run (minutes on two cores)
def test_partial_rollout_segments_of_several_policy_versions_reach_the_loss(rehearsal, record_property):
    """Partial rollouts (the 64k preset's block at tiny budgets: 4 segments of 2 tokens, stale segments
    kept, 2 batches of prompts prefilled): responses sampled in
    segments by two or more policy versions (the generation workers record the optimizer steps their
    weights had seen) reach the loss after sharding and packing with each segment's own behaviour
    log-probs, unmasked (keep)."""
    info = rehearsal["info"]
    record_property("partial_rollouts", json.dumps(info["partial_rollouts"]))
    # The prefill pool ran as configured: before step 1 the driver moved prefill_batches extra batches of
    # prompts into flight, and the last checkpoint carries unfinished groups for a resumed run.
    hook_state = json.loads((rehearsal["root"] / "checkpoints" / f"step_{STEPS}" / "partial_rollouts.json").read_text())
    prefill = info["partial_rollouts"]["prefill_batches"]
    assert (hook_state["prefilled_batches"], hook_state["batches_seen"]) == (prefill, STEPS + prefill)
    assert hook_state["manager"]["active"] or hook_state["manager"]["pending"], "no group in flight at the end"
    segments = generation_segments(rehearsal["record"])
    assert segments and all(len(s["tokens"]) <= info["partial_rollouts"]["token_budget"] for s in segments)
    mixed = 0
    for step in optimizer_steps(rehearsal):
        for record in step["ranks"].values():
            if record["coords"]["tp"] or record["coords"]["cp"]:
                continue
            for call in record["loss_calls"]:
                data = call["data"]
                for j in range(data["input_ids"].shape[0]):
                    versions = _segment_versions(data, j, segments)
                    mixed += len(set(versions)) >= 2
    assert mixed >= 1, "no response written by two policy versions reached the loss"


def _segment_versions(data, j: int, segments: list[dict]) -> list[int]:
    """The policy versions of the segments a loss row's response is made of; checks on the way that each
    segment reached the loss with its own behaviour log-probs and an unmasked token mask."""
    n = int(data["input_lengths"][j])
    ids = data["input_ids"][j, :n].tolist()
    versions = []
    pos = next(k for k in range(n) if data["token_mask"][j, k] > 0) if data["token_mask"][j].any() else n
    while pos < n:
        received = data["generation_logprobs"][j].tolist()
        candidates = [s for s in segments if s["context"] == ids[:pos] and s["tokens"] == ids[pos : pos + len(s["tokens"])]
                      and s["tokens"] and s["logprobs"] == pytest.approx(received[pos : pos + len(s["tokens"])], abs=1e-6)]
        assert candidates, f"tokens {pos}.. of a loss row came from no recorded segment with these log-probs"
        segment = candidates[-1]
        assert data["token_mask"][j, pos : pos + len(segment["tokens"])].tolist() == [1] * len(segment["tokens"])
        versions.append(segment["policy_steps"])
        pos += len(segment["tokens"])
    return versions


@pytest.mark.slow  # shares the module's rehearsal run (minutes on two cores)
def test_the_checkpoint_goes_through_every_workers_save(rehearsal):
    """The last step's checkpoint is written through every worker's real save_checkpoint (megatron-core
    distributed checkpoint in Megatron-Bridge's layout, sharded over TP x CP x DP), with the partial
    rollouts and the parity log-probs the driver adds; the run logs every step into one MLflow run."""
    import mlflow

    (run,) = rehearsal["runs"]
    assert run["train_calls"] == STEPS * PROMPTS * GENERATIONS // GLOBAL_BATCH
    step_dir = rehearsal["root"] / "checkpoints" / f"step_{STEPS}"
    assert (step_dir / "policy" / "weights" / "latest_checkpointed_iteration.txt").read_text() == "0"
    iteration = step_dir / "policy" / "weights" / "iter_0000000"
    # common state in common.pt (the layout v0.7.0's stack writes and reads) or embedded (megatron-core 0.17+)
    assert (iteration / ".metadata").exists()
    assert (iteration / "common.pt").exists() or (iteration / "metadata.json").exists()
    assert (step_dir / "partial_rollouts.json").exists()
    records = policy_records(rehearsal["record"])
    for rank, recs in records.items():
        (save,) = of_kind(recs, "save")
        # main: the save returned with its writes pending; grpo's begin_finalization waited for them
        # (finalize_async_save) before the rename, so the step's directory was complete when it appeared
        assert save["pending_writes"] == (1 if async_checkpoint_saves() else 0), rank
    # The parity file the driver records at every checkpoint (for `bapo-nemo export`) went through the
    # workers' real get_logprobs: it holds the saved weights' log-probs.
    from bapo_nemo.export.parity import read_reference_logprobs

    parity = read_reference_logprobs(step_dir)
    saved = weights_of(records, "save", 0)
    for sequence, row in zip(parity["sequences"], parity["logprobs"]):
        want = reference_logprobs(saved, {"input_ids": torch.tensor([sequence])})[0, 1:]
        assert torch.allclose(torch.tensor(row), want, atol=1e-5)
    done = json.loads((step_dir / "training_info.json").read_text())
    assert done["total_steps"] == STEPS
    client = mlflow.tracking.MlflowClient(rehearsal["assets"]["mlflow"])
    (logged,) = client.search_runs([client.get_experiment_by_name("rehearsal").experiment_id])
    for key in ("train/loss", "train/bapo/c_high"):
        assert sorted(m.step for m in client.get_metric_history(logged.info.run_id, key)) == list(range(1, STEPS + 1))


# ---- negative controls -----------------------------------------------------------------------------------
HARNESS_BATCH, HARNESS_LENGTH = 16, 12


def harness_batch(weights: dict, tokenizer, seed: int = 0) -> dict:
    """A global batch of 16 responses of one length (each packs into a bin of its own, so every DP rank
    runs 8 micro-batches): even rows advantage +1, odd rows -1, behaviour log-probs off the policy's by
    up to e^0.4, so the searches have ratios to weigh."""
    g = torch.Generator().manual_seed(seed)
    prompt = tokenizer.encode("1+2=?", add_special_tokens=False)
    answer = [tokenizer.convert_tokens_to_ids(c) for c in " 3"] + [tokenizer.eos_token_id]
    rows = []
    for _ in range(HARNESS_BATCH):
        filler = torch.randint(4, 14, (HARNESS_LENGTH - len(prompt) - len(answer),), generator=g).tolist()
        rows.append(prompt + filler + answer)
    input_ids = torch.tensor(rows)
    token_mask = torch.zeros(HARNESS_BATCH, HARNESS_LENGTH)
    token_mask[:, len(prompt):] = 1
    current = reference_logprobs(weights, {"input_ids": input_ids})
    return {
        "input_ids": input_ids,
        "input_lengths": torch.full((HARNESS_BATCH,), HARNESS_LENGTH),
        "token_mask": token_mask,
        "sample_mask": torch.ones(HARNESS_BATCH),
        "advantages": torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(HARNESS_BATCH)])[:, None].expand(-1, HARNESS_LENGTH).clone(),
        "prev_logprobs": current,
        "generation_logprobs": current + 0.4 * (2 * torch.rand(current.shape, generator=g) - 1) * token_mask,
    }


def check_microbatch_scenario(records: dict[int, list[dict]], weights: dict, config: dict) -> None:
    """granularity: microbatch on 8 ranks against one process: micro-batch i's bounds are the search over
    the union of every DP rank's micro-batch i (as the loss's DP all-reduce should make them) on every
    rank, and the loss and DP x CP-reduced gradients equal BAPOLossFn + autograd in one process with those
    bounds."""
    from bapo_nemo.nemo.step_bounds import attach_bounds

    options = bapo_options(config)
    ranks = {r: of_kind(recs, "train")[0] for r, recs in records.items()}
    leaders = [of_kind(recs, "train")[0] for recs in at(records, tp=0, cp=0)]
    counts = {len(rec["loss_calls"]) for rec in ranks.values()}
    assert len(counts) == 1 and counts.pop() >= 2, "every rank must run the same number (2+) of micro-batches"
    unions = []
    for i in range(len(leaders[0]["loss_calls"])):
        calls = [rec["loss_calls"][i] for rec in leaders]
        union = {k: torch.cat([c["data"][k] for c in calls]) for k in
                 ("input_ids", "input_lengths", "token_mask", "sample_mask", "advantages", "prev_logprobs",
                  "generation_logprobs")}
        logprobs = torch.cat([torch.nn.functional.pad(c["logprobs"], (1, 0)) for c in calls])
        expected = search_over(union, logprobs, options)
        for rank, record in ranks.items():
            call = record["loss_calls"][i]
            mask = call["data"]["token_mask"][:, 1:] * call["data"]["sample_mask"].unsqueeze(-1)
            weight = float(mask.sum()) / call["global_valid_toks"]
            used = (call["metrics"]["bapo/c_low"] / weight, call["metrics"]["bapo/c_high"] / weight)
            assert used == pytest.approx((expected.c_low, expected.c_high), abs=1e-9), f"micro-batch {i}, rank {rank}"
        attach_bounds(union, expected)
        unions.append(union)
    check_step_against_reference(unions, ranks, weights, grads_of(records, 0), config["loss_fn"])


@pytest.fixture(scope="module")
def harness_records(tmp_path_factory):
    """The three scenarios on 8 gloo ranks (one subprocess; see tests/support/nemo_megatron_harness.py)."""
    from transformers import AutoTokenizer

    from bapo_nemo.nemo.packing import fused_loss_width, pad_sequence_dim
    from tests.support.nemo_vllm_standins import load_weights, write_rehearsal_model

    root = tmp_path_factory.mktemp("harness")
    model = write_rehearsal_model(root / "tiny_lm", positions=SEQUENCE)
    config_path, _ = rehearsal_config(root, {"model": model, "train": root / "unused.jsonl", "mlflow": "sqlite://"})
    config = load_preset(config_path)
    config["loss_fn"]["bapo"]["granularity"] = "microbatch"  # the path whose statistics are reduced over DP
    policy = config["policy"]
    policy["megatron_cfg"]["train_iters"] = 1
    policy["train_global_batch_size"] = HARNESS_BATCH
    weights = load_weights(model)
    batch = harness_batch(weights, AutoTokenizer.from_pretrained(model))
    width = fused_loss_width(policy)  # as the driver widens it (bapo_nemo/nemo/packing.py)
    torch.save(dict(pad_sequence_dim(batch, width)), root / "batch.pt")
    scenarios = ["as_shipped", "tensor_parallel_group", "no_cp_normalization"]
    spec = {"policy": policy, "loss_fn": config["loss_fn"], "batch": str(root / "batch.pt"), "out": str(root / "out"),
            "scenarios": scenarios, "gbs": HARNESS_BATCH, "world": TP * CP * DP}
    (root / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "tests.support.nemo_megatron_harness", str(root / "spec.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {s: policy_records(root / "out" / s) for s in scenarios}, weights, config


@pytest.mark.slow  # 8 gloo ranks in a subprocess
def test_the_comparison_passes_as_shipped_and_fails_with_a_planted_defect(harness_records):
    """The same comparison on 8 gloo ranks (granularity microbatch, the path that sums BAPO's statistics
    over the DP group): it holds for upstream's code as shipped, and fails when BAPO's statistics are summed
    over the tensor-parallel group instead (the bounds), and when NeMo-RL's LossPostProcessor skips its
    division by the CP size (the gradients double)."""
    records, weights, config = harness_records
    check_microbatch_scenario(records["as_shipped"], weights, config)
    with pytest.raises(AssertionError, match="micro-batch"):
        check_microbatch_scenario(records["tensor_parallel_group"], weights, config)
    with pytest.raises(AssertionError, match="gradient of"):
        check_microbatch_scenario(records["no_cp_normalization"], weights, config)
