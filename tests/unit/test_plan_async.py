"""Async GRPO in the generation model of `bapo-nemo check` (plan/simulation/live_engine.py, plan/simulation/async_generation.py):
the live engine against the batch engine, a weight update splitting a response's tokens between two
policy versions, NeMo-RL's async loop on hand-computable cases (equal lengths with the generation side
the bottleneck, without and with in-flight updates and KV recompute; the training side the bottleneck at
ages 1 and 2), and NeMo-RL's published 1-step off-policy Qwen3-32B step as an anchor."""

from __future__ import annotations

import random

import pytest
import yaml

from bapo_nemo.plan.rules.models import BUILTIN
from bapo_nemo.plan.simulation.async_generation import AsyncSetting, simulate_async, transfer_seconds
from bapo_nemo.plan.simulation.engine_sim import Engine, Request, engine_for, run_engine
from bapo_nemo.plan.simulation.generation import RolloutShape, response_moments
from bapo_nemo.plan.simulation.live_engine import LiveEngine, LiveRequest
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.plan.simulation.step_time import TrainCost, shape_from_config, train_cost

MS = 1e-3


def engine(**over) -> Engine:
    """tests/unit/test_plan_generation.py's round numbers: a decode step's dense part 1 ms (up to 10 running
    requests), 0.1 us per cached token read, 0.1 ms per prefilled token."""
    base = {
        "gpus": 1, "weight_bytes": 1e9, "kv_bytes_per_token": 1e5, "kv_tokens": 10**6, "max_num_seqs": 1024,
        "hbm_bytes_per_s": 1e12, "flops_per_s": 1e12, "dense_flops_per_token": 1e8, "attention_flops_per_key": 0.0,
    }
    base.update(over)
    return Engine(**base)


def run_live(e: Engine, requests: list[Request]) -> float:
    """Every request submitted at 0 and the engine advanced event by event, as the async loop drives it."""
    live = LiveEngine(e)
    for r in requests:
        live.submit(LiveRequest(r.key, r.key, r.context, r.new_tokens))
    ended = []
    while (t := live.next_event()) != float("inf"):
        ended += live.advance(t)
    assert sorted(q.key for q in ended) == sorted(r.key for r in requests)
    assert all(sum(n for _, n in q.versions) == q.new_tokens for q in ended)
    return max(q.end_time for q in ended)


def test_live_engine_runs_one_call_as_the_batch_engine_does():
    """Fed one call's rows at once, the live engine is engine_sim.run_engine (its independent twin): the
    same time on random lengths, slot limits and KV caches small enough to preempt."""
    rng = random.Random(5)
    for _ in range(40):
        e = engine(kv_tokens=rng.choice([400, 1000, 10**6]), max_num_seqs=rng.choice([2, 8, 1024]))
        requests = [Request(i, rng.randint(1, 40), rng.randint(1, 150)) for i in range(rng.randint(1, 12))]
        assert run_live(e, requests) == pytest.approx(run_engine(e, requests).seconds)


def test_weight_update_between_decode_steps_splits_the_versions_by_hand():
    """4 requests of 10 context tokens and 100 new ones: prefill 4 ms, then 1 ms + 0.1 us x cached tokens
    per step. Advanced to 50 ms, the engine stops after the 45th step (4 + 45.576 ms; the 46th would end at
    50.598 ms). A 10 ms transfer there, then the last 55 steps (55 ms + 0.1 us x (55 x 220 + 4 x 55 x 54 / 2)
    = 56.804 ms): each response holds 45 tokens of version 0 and 55 of version 1, and ends at
    4 + 45.576 + 10 + 56.804 ms. With recompute the 4 contexts of 55 tokens are prefilled again: 22 ms more."""
    for recompute, extra in ((False, 0.0), (True, 22.0)):
        live = LiveEngine(engine())
        requests = [LiveRequest(i, 0, 10, 100) for i in range(4)]
        for r in requests:
            live.submit(r)
        assert live.advance(50 * MS) == []
        assert live.t == pytest.approx(49.576 * MS) and live.tokens_so_far() == 180
        live.update_weights(10 * MS, version=1, recompute=recompute)
        ended = live.advance(1.0)
        assert [r.versions for r in ended] == [[[0, 45], [1, 55]]] * 4
        assert ended[0].end_time == pytest.approx((4 + 45.576 + 10 + 56.804 + extra) * MS)
        assert live.stall_s == pytest.approx(10 * MS)


def _shape(**over) -> RolloutShape:
    base = {
        "engines": 1, "engine": engine(), "prompts_per_step": 2, "group_size": 2, "prompt_tokens": 10,
        "max_new_tokens": 200, "max_model_len": 1000,
    }
    base.update(over)
    return RolloutShape(**base)


EQUAL = LengthModel(1000, empirical=(100,))  # every response 100 tokens
# One batch (4 sequences of 110 tokens) takes `seconds` to train.
def train_for(seconds: float) -> TrainCost:
    return TrainCost(seconds / 440, 0.0)


def test_generation_bound_equal_lengths_by_hand():
    """2 prompts x 2 responses per step on one engine; every response 100 tokens; training 50 ms; a 10 ms
    weight transfer. A batch on an empty engine takes 4 ms of prefill and 102.38 ms of decode (100 steps
    of 4 requests holding 40 + 4j tokens): 106.38 ms, longer than training, so generation is the
    bottleneck.

    - Age 1, no in-flight updates: the update waits for the next batch to end, then 10 ms of transfer;
      the next batch starts after it. Step = 106.38 + 10 ms; the trainer waits 116.38 - 50 ms per step,
      the engine only for the transfer; every token was sampled one version before it is trained.
    - In-flight updates: the update lands 50 ms after the batch began (after its 45th decode step, see the
      test above): 45 of each response's 100 tokens come from the older policy, 55 from the trained one:
      0.45 versions per token, while NeMo-RL's per-trajectory record says 1. The checkpoint after it sees
      the 2 groups in flight with 180 tokens. Equal lengths leave no tail to hide: the same step.
    - KV recomputed: the 4 running contexts of 55 tokens are prefilled again at each update: 22 ms more.
    """
    stats = simulate_async(_shape(), EQUAL, AsyncSetting(1), train_for(50 * MS), 10 * MS, steps=3)
    assert stats.step_s == pytest.approx(116.38 * MS) and stats.tokens == 400
    assert stats.train_idle_s == pytest.approx((116.38 - 50) * MS)
    assert stats.generation_idle_s == pytest.approx(10 * MS)
    assert (stats.staleness_mean, stats.staleness_max, stats.response_staleness_mean) == (1.0, 1.0, 1.0)
    assert stats.fill_s == pytest.approx(106.38 * MS)
    assert (stats.buffer_groups, stats.in_flight_groups) == (2, 0)  # the next batch is done when it saves

    in_flight = simulate_async(_shape(), EQUAL, AsyncSetting(1, True), train_for(50 * MS), 10 * MS, steps=3)
    assert in_flight.step_s == pytest.approx(116.38 * MS)
    assert in_flight.staleness_mean == pytest.approx(0.45) and in_flight.stale_token_share == pytest.approx(0.45)
    assert in_flight.response_staleness_mean == 1.0 and in_flight.mixed_response_share == 1.0
    assert (in_flight.in_flight_groups, in_flight.in_flight_tokens, in_flight.buffer_groups) == (2, 180, 0)

    recompute = simulate_async(_shape(), EQUAL, AsyncSetting(1, True, True), train_for(50 * MS), 10 * MS, steps=3)
    assert recompute.step_s == pytest.approx((116.38 + 22) * MS)


def test_training_bound_by_hand():
    """Training 300 ms per batch, generation 106.38 ms: the trainer never waits for a batch, only for the
    10 ms transfer; step = 310 ms; the engine waits 310 - 106.38 ms per step (the transfer included).
    The collector runs as far ahead as the age allows, so the trained tokens are exactly the age old:
    1 at age 1, 2 at age 2, in-flight updates or not (no generation is running at an update)."""
    for setting, age in ((AsyncSetting(1), 1), (AsyncSetting(2), 2), (AsyncSetting(2, True), 2)):
        stats = simulate_async(_shape(), EQUAL, setting, train_for(300 * MS), 10 * MS, steps=3)
        assert stats.step_s == pytest.approx(310 * MS)
        assert stats.train_idle_s == pytest.approx(10 * MS)
        assert stats.generation_idle_s == pytest.approx((310 - 106.38) * MS)
        assert stats.staleness_mean == age and stats.staleness_max == age
        assert stats.buffer_groups == 2 * age  # finished batches waiting for their steps
    # at age 2 the first fill runs both batches together: 8 ms of prefill, 100 steps of 8 requests
    # (100 ms + 0.1 us x (8,000 + 8 x 4,950)) = 112.76 ms before the first step
    assert stats.fill_s == pytest.approx(112.76 * MS)


def test_transfer_is_the_bf16_weights_over_one_nic():
    model = BUILTIN["Qwen/Qwen3-32B"]
    assert transfer_seconds(model) == pytest.approx(model.num_parameters() * 2 / 40e9)


# NeMo-RL's 1-step off-policy recipe (v0.7.0 examples/configs/recipes/llm/performance/
# grpo-qwen3-32b-8n8g-async-1off.yaml over grpo-qwen3-32b-4n8g.yaml): 4 generation nodes (8 vLLM engines of
# TP 4 at gpu_memory_utilization 0.8), 32 training GPUs (TP 4 x PP 4), in-flight updates, age 1. The keys
# the training side reads, by hand:
ASYNC_ANCHOR = """
grpo: {num_prompts_per_step: 64, num_generations_per_prompt: 32}
loss_fn: {force_on_policy_ratio: true, use_importance_sampling_correction: true}
policy:
  model_name: Qwen/Qwen3-32B
  train_global_batch_size: 2048
  max_total_sequence_length: 4096
  dtensor_cfg: {enabled: false}
  megatron_cfg: {enabled: true, tensor_model_parallel_size: 4, pipeline_model_parallel_size: 4,
                 activation_checkpointing: false, fp8_cfg: {enabled: false}}
"""
# Published (NeMo-RL v0.5 performance summary, H100): 538 tokens/s/GPU on 64 GPUs, 200 s per step: 6.89M
# tokens per step, the same batch as the on-policy anchor of tests/unit/test_plan_step_time.py (whose length
# model is reused: 150 prompt tokens, responses log-normal with sigma 0.8 and the median that gives
# 3,205 response tokens on average under the 3,946-token cap).
ASYNC_ANCHOR_STEP_S = 200.0
ANCHOR_MEDIAN = 4234.3
ANCHOR_TOLERANCE = 0.25


def test_anchor_nemo_rl_qwen3_32b_one_step_off_policy():
    """The refit's wait, offload and data movement are left out, so the estimate lands low, within 25%.
    Generation on 32 GPUs (~100 s a batch) outruns training on 32 (4 passes: reference log-probs + 3),
    so the step is the training's plus the transfer, and every trained token is one version old."""
    config = yaml.safe_load(ASYNC_ANCHOR)
    model = BUILTIN["Qwen/Qwen3-32B"]
    shape = RolloutShape(8, engine_for(model, "h100-80gb", 80e9, 4, 2.0, 2.0, 0.8), 64, 32, 150, 4096, 4096)
    lengths = LengthModel(4096, ANCHOR_MEDIAN, 0.8)
    mean, mean_squared = response_moments(shape, lengths)
    step = shape_from_config(config, train_gpus=32, tokens_per_sample=mean, tokens_squared_per_sample=mean_squared)
    assert step.logprob_passes == 1.0  # the reference model's; force_on_policy_ratio skips prev_logprobs
    stats = simulate_async(shape, lengths, AsyncSetting(1, True), train_cost(model, step, "h100-80gb"),
                           transfer_seconds(model), steps=3)
    assert stats.step_s == pytest.approx(ASYNC_ANCHOR_STEP_S, rel=ANCHOR_TOLERANCE)
    assert stats.step_s < ASYNC_ANCHOR_STEP_S
    assert stats.train_idle_s == pytest.approx(stats.transfer_s, rel=0.05)  # training-bound
    assert stats.staleness_mean == 1.0
