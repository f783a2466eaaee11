"""The generation model of `bapo-nemo check` (plan/simulation/engine_sim.py, plan/simulation/generation.py): one engine's
continuous batching on hand-computable cases (all lengths equal, a slot limit, one long outlier, a full
KV cache with preemption and a partly evicted prefix cache), a call over several engines, the steady
state of partial rollouts and segmented validation by hand, and the lengths-only pool against the real
PartialRolloutManager."""

from __future__ import annotations

import random

import pytest

from bapo_nemo.plan.simulation.engine_sim import Engine, PrefixCache, Request, run_call, run_engine
from bapo_nemo.plan.simulation.generation import (
    PartialRolloutPool,
    RolloutShape,
    simulate_partial,
    simulate_validation,
    simulate_without_partial,
)
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.rollout import GenerationChunk, PartialRolloutConfig, PartialRolloutManager, PromptItem
from bapo_nemo.rollout.balance import balanced_order

MS = 1e-3


def engine(**over) -> Engine:
    """Round numbers: a decode step's dense part reads 1 GB at 1 TB/s = 1 ms (its compute, 0.1 ms per
    running request, wins above 10 of them); each cached token read costs 0.1 us; a prefilled token
    0.1 ms; no attention FLOPs, no tensor parallelism."""
    base = {
        "gpus": 1,
        "weight_bytes": 1e9,
        "kv_bytes_per_token": 1e5,
        "kv_tokens": 10**6,
        "max_num_seqs": 1024,
        "hbm_bytes_per_s": 1e12,
        "flops_per_s": 1e12,
        "dense_flops_per_token": 1e8,
        "attention_flops_per_key": 0.0,
    }
    base.update(over)
    return Engine(**base)


def requests(*new_tokens: int, context: int = 10) -> list[Request]:
    return [Request(i, context, n) for i, n in enumerate(new_tokens)]


def test_decode_steps_by_hand():
    e = engine()
    # 4 requests, 5 steps: 5 x 1 ms + 0.1 us x (40 + 44 + 48 + 52 + 56 = 240 cached tokens)
    assert e.run_seconds(4, 40, 5) == pytest.approx(5 * MS + 240 * 1e-7)
    assert e.run_seconds(4, 40, 5) == pytest.approx(sum(e.step_seconds(4, 40 + 4 * j) for j in range(5)))
    # 20 requests: the dense part is compute-bound, 20 x 0.1 ms = 2 ms per step
    assert e.step_seconds(20, 0) == pytest.approx(2 * MS)
    # tensor parallelism adds the all-reduces per step: 3 us + 1 us per running request
    assert engine(allreduce_s=3e-6, allreduce_s_per_sequence=1e-6).run_seconds(4, 0, 10) == pytest.approx(
        10 * (MS + 7e-6) + 1e-7 * 4 * 45
    )
    # prefill: 0.1 ms per uncached token, attention 2 L q (T^2 - C^2) when it has FLOPs
    assert e.prefill_seconds(110, cached=40) == pytest.approx(70 * 0.1 * MS)
    assert engine(attention_flops_per_key=2e6).prefill_seconds(100) == pytest.approx(
        (100 * 1e8 + 2e6 * 100 * 100 / 2) / 1e12
    )


def test_all_lengths_equal_by_hand():
    """4 requests of 10 context tokens that each generate 100: prefill 4 x 10 x 0.1 ms = 4 ms; 100 steps
    of 4 requests holding 40 + 4j tokens: 100 ms + 0.1 us x 23,800 = 102.38 ms."""
    stats = run_engine(engine(), requests(100, 100, 100, 100))
    assert stats.seconds == pytest.approx(106.38 * MS)
    assert (stats.tokens, stats.prefill_tokens, stats.preemptions) == (400, 40, 0)
    # a slot limit of 2: two waves of 2 ms prefill + 100 ms + 0.1 us x 11,900
    waves = run_engine(engine(max_num_seqs=2), requests(100, 100, 100, 100))
    assert waves.seconds == pytest.approx(2 * (2 + 100 + 1.19) * MS)
    # 20 requests of 1 context token and 10 new ones: compute-bound steps of 2 ms
    many = run_engine(engine(), requests(*[10] * 20, context=1))
    assert many.seconds == pytest.approx((2 + 10 * 2 + 0.11) * MS)  # keys: 10 x 20 + 20 x 45 = 1,100


def test_one_long_outlier_by_hand():
    """Three requests of 100 tokens and one of 1,000: 100 steps of 4, then 900 steps of the outlier
    alone (holding 110 + j tokens): 900 ms + 0.1 us x 503,550. On two engines of two requests each the
    call waits for the engine with the outlier; cut at 100 tokens, both end together."""
    alone = run_engine(engine(), requests(100, 100, 100, 1000))
    assert alone.seconds == pytest.approx((4 + 102.38 + 950.355) * MS)
    seconds, total, per_engine = run_call(2, engine(), requests(100, 100, 100, 1000))
    assert [e.seconds for e in per_engine] == pytest.approx([103.19 * MS, (2 + 101.19 + 950.355) * MS])
    assert seconds == per_engine[1].seconds and total.tokens == 1300
    cut, _, _ = run_call(2, engine(), requests(100, 100, 100, 100))
    assert cut == pytest.approx(103.19 * MS)


def test_full_cache_preempts_the_newest_and_recomputes_what_was_evicted():
    """A 150-token KV cache, two requests of 10 + 100 tokens. Both run 65 steps (the cache is then
    full: 2 x 75); the newer one is preempted (its 75 tokens go to the prefix cache), the older one
    finishes its last 35 steps while its growth evicts the preempted tail down to 40 cached tokens; the
    preempted one is readmitted, prefills 75 - 40 = 35 tokens and runs its last 35 steps."""
    e = engine(kv_tokens=150)
    stats = run_engine(e, requests(100, 100), trace=True)
    two = 65 * MS + 1e-7 * (65 * 20 + 2 * 65 * 64 / 2)
    one = 35 * MS + 1e-7 * (35 * 75 + 35 * 34 / 2)
    assert stats.seconds == pytest.approx(2 * MS + two + one + 3.5 * MS + one)
    assert (stats.preemptions, stats.prefill_tokens, stats.cached_tokens, stats.tokens) == (1, 55, 40, 200)
    assert [row[2] for row in stats.trace if row[4] == "decode"] == [2, 1, 1]  # running requests
    assert max(row[3] for row in stats.trace) <= 150


def test_prefix_cache_evicts_least_recently_used_tails():
    cache = PrefixCache()
    cache.put("a", 100)
    cache.put("b", 50)
    cache.fit(120)  # the oldest entry loses its tail first
    assert cache.entries == {"a": 70, "b": 50} and cache.tokens == 120
    assert cache.take("a") == 70 and cache.take("a") == 0 and cache.tokens == 50
    cache.fit(0)
    assert cache.entries == {} and cache.tokens == 0


def test_rows_are_dealt_to_the_engines_by_context():
    # 8 rows, 2 engines of 4 rows: ranks 0, 3, 4, 7 to the first, 1, 2, 5, 6 to the second (snake order)
    assert balanced_order([1, 2, 3, 4, 5, 6, 7, 8], 2) == [7, 4, 3, 0, 6, 5, 2, 1]
    # 5 rows on 2 engines: the first takes 3, as NeMo-RL cuts ceil(5 / 2) rows per shard
    assert balanced_order([5, 5, 1, 1, 9], 2) == [4, 2, 3, 0, 1]
    assert balanced_order([3, 1, 2], 1) == [0, 1, 2]


def _shape(**over) -> RolloutShape:
    base = {
        "engines": 1, "engine": engine(), "prompts_per_step": 4, "group_size": 1, "prompt_tokens": 10,
        "max_new_tokens": 200, "max_model_len": 1000,
    }
    base.update(over)
    return RolloutShape(**base)


def test_partial_rollouts_steady_state_by_hand():
    """Every response is 200 tokens; budget 100, one extra batch in the pool. Without partial rollouts a
    step prefills 4 x 10 tokens and runs 200 steps of 4 requests (40 + 4j cached tokens): 4 + 200 +
    8.76 = 212.76 ms. With them, every step continues the 4 responses of the step before (110 tokens of
    context each, prefilled again: the cache was reset) next to 4 fresh ones: 48 ms of prefill, then
    100 steps of 8 requests holding 480 + 8j tokens: 108.76 ms. Both hand out 800 tokens per step; half
    of them were written one policy version earlier."""
    lengths = LengthModel(1000, empirical=(200,))
    without = simulate_without_partial(_shape(), lengths, steps=2)
    assert without.generation_s == pytest.approx(212.76 * MS) and without.tokens == 800
    budget = PartialRolloutConfig(token_budget=100, max_resumptions=1, stale_segments="keep")
    with_partial = simulate_partial(_shape(), lengths, budget, prefill_batches=1, steps=3)
    assert with_partial.generation_s == pytest.approx((48 + 108.76) * MS)
    assert with_partial.tokens == 800 and with_partial.iterations == 1
    assert with_partial.staleness_mean == pytest.approx(0.5) and with_partial.stale_token_share == pytest.approx(0.5)
    assert with_partial.staleness_max == 1 and with_partial.truncated_share == 0
    assert with_partial.tokens_per_s / without.tokens_per_s == pytest.approx(212.76 / 156.76)
    # a resumption cap of 0 cuts every response at its first segment, as the manager does
    capped = simulate_partial(
        _shape(), lengths, PartialRolloutConfig(token_budget=100, max_resumptions=0), prefill_batches=1, steps=2
    )
    assert capped.tokens == 400 and capped.truncated_share == 1


def test_segmented_validation_costs_nothing_extra_while_the_prefix_cache_holds():
    """Validation of 4 answers of 200 tokens in two segment calls: the second finds each context in the
    prefix cache (no prefill) and reads 440 + 4j cached tokens: 4 + 102.38 + 106.38 ms, the same as one
    call of 200 steps. With the cache reset between the calls (as between training steps), the second
    call prefills 4 x 110 tokens: 44 ms more."""
    lengths = LengthModel(1000, empirical=(200,))
    shape = _shape(validation_samples=4, validation_batch=4)
    assert simulate_validation(shape, lengths) == pytest.approx(212.76 * MS)
    assert simulate_validation(shape, lengths, PartialRolloutConfig(token_budget=100)) == pytest.approx(212.76 * MS)
    first = requests(100, 100, 100, 100)
    second = [Request(r.key, 110, 100) for r in first]
    caches = [PrefixCache()]
    t1, _, _ = run_call(1, engine(), first, caches)
    t2, kept, _ = run_call(1, engine(), second, caches)
    t3, reset, _ = run_call(1, engine(), second, [PrefixCache()])
    assert (t1, t2, t3) == pytest.approx((106.38 * MS, 106.38 * MS, 150.38 * MS))
    assert (kept.cached_tokens, reset.cached_tokens, reset.prefill_tokens) == (440, 0, 440)


def test_pool_schedules_and_hands_out_like_the_manager():
    """PartialRolloutPool (lengths only) and PartialRolloutManager side by side on random lengths, caps,
    budgets and admission limits: the same responses get the same segments in every iteration, end for
    the same reasons, and leave in the same groups."""
    rng = random.Random(3)
    for trial in range(30):
        group_size = rng.randint(1, 3)
        config = PartialRolloutConfig(
            token_budget=rng.randint(1, 5),
            max_resumptions=rng.randint(0, 4),
            max_response_tokens=rng.choice([None, rng.randint(3, 15)]),
            global_token_budget=rng.choice([None, 24]),
            max_in_flight_groups=rng.choice([None, 3, 5]),
            prompts_per_iteration=rng.choice([None, 2]),
        )
        if config.global_token_budget is not None and config.global_token_budget < config.token_budget:
            continue
        manager, pool = PartialRolloutManager(config, group_size), PartialRolloutPool(config, 10**9)
        prompt_cap = rng.randint(4, 20)
        for step in range(8):
            batch = [[rng.randint(1, 18) for _ in range(group_size)] for _ in range(2)]
            pool.add(batch, cap=prompt_cap)
            manager.add_prompts(
                [PromptItem(f"{step}:{i}", [7], {"lengths": g}, prompt_cap) for i, g in enumerate(batch)]
            )
            scheduled = pool.schedule()

            def generate(contexts, max_new, scheduled=scheduled):
                # the manager asks in its own schedule order; the pool's order must be the same
                assert len(contexts) == len(scheduled)
                out = []
                for ctx, (_, r) in zip(contexts, scheduled):
                    assert len(ctx) - 1 == r.done
                    n = min(max_new, r.length - r.done)
                    out.append(GenerationChunk([1] * n, [0.0] * n, finished=r.done + n == r.length))
                return out

            handed = manager.run_iteration(generate, step, max_groups=2)
            pool.apply(scheduled, step)
            mine = pool.hand_out(2)
            assert [g.prompt_id for g in handed] == [f"{g.order // 2}:{g.order % 2}" for g in mine], trial
            for got, want in zip(handed, mine):
                for r, q in zip(got.rollouts, want.responses):
                    assert len(r.response_token_ids) == q.done and r.truncated == q.truncated, trial
                    assert r.num_segments == q.segments
                    assert r.token_versions == [v for v, n in q.versions for _ in range(n)]
