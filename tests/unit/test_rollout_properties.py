"""Property tests of partial rollouts over random settings, driven by the seeded ToyPolicy generator:
no token lost or duplicated across segments, versions non-decreasing, behaviour log-probs equal the
sampler's, budgets and caps honoured, only complete groups, every prompt handed out exactly once, and a
save/load at any iteration changes nothing."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bapo_nemo.rollout import PartialRolloutConfig, PartialRolloutManager, PromptItem
from tests.support.toy_rollouts import ToyPolicy

configs = st.builds(
    PartialRolloutConfig,
    token_budget=st.integers(1, 5),
    max_resumptions=st.integers(0, 4),
    max_response_tokens=st.one_of(st.none(), st.integers(1, 12)),
    global_token_budget=st.one_of(st.none(), st.integers(5, 14)),
    max_in_flight_groups=st.one_of(st.none(), st.integers(1, 3)),
    prompts_per_iteration=st.one_of(st.none(), st.integers(1, 3)),
    stale_segments=st.sampled_from(["keep", "exclude", "downweight"]),
    stale_weight_decay=st.sampled_from([0.5, 0.9, 1.0]),
)


def _drain(cfg, group_size, n_prompts, seed, interrupt_at=None, max_iterations=200):
    policy = ToyPolicy(seed=seed, vocab_size=5, eos_logit_bias=-1.0)
    manager = PartialRolloutManager(cfg, group_size)
    prompts = [PromptItem(f"p{i}", [i % 3 + 1, i], {"i": i}) for i in range(n_prompts)]
    groups, versions = [], []
    v = 0
    while (
        manager.num_pending or manager.num_in_flight or manager.num_completed or prompts
    ) and v < max_iterations:
        if prompts:  # two new prompts per iteration, like a dataloader
            manager.add_prompts(prompts[:2])
            prompts = prompts[2:]
        if v == interrupt_at:
            state = json.loads(json.dumps(manager.state_dict()))
            manager = PartialRolloutManager(cfg, group_size)
            manager.load_state_dict(state)
        out = manager.run_iteration(policy.bind(v), v)
        groups.extend(out)
        versions.extend([v] * len(out))
        v += 1
    return groups, versions, policy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, group_size=st.integers(1, 3), n_prompts=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_partial_rollout_invariants(cfg, group_size, n_prompts, seed):
    groups, handed_at, policy = _drain(cfg, group_size, n_prompts, seed)
    # every prompt handed out exactly once, as a complete group
    assert sorted(g.prompt_id for g in groups) == sorted(f"p{i}" for i in range(n_prompts))
    used = []  # (version, context, tokens, logprobs, cut at the length cap?) of every segment handed out
    for group, v_out in zip(groups, handed_at):
        assert len(group.rollouts) == group_size
        for r in group.rollouts:
            n = len(r.response_token_ids)
            assert len(r.behavior_logprobs) == len(r.token_versions) == len(r.loss_weights) == n
            assert sum(r.segment_lengths) == n and r.num_segments == len(r.segment_lengths)
            assert all(s <= cfg.token_budget for s in r.segment_lengths)
            assert r.num_segments <= cfg.max_resumptions + 1
            if cfg.max_response_tokens is not None:
                assert n <= cfg.max_response_tokens
            assert r.token_versions == sorted(r.token_versions)
            assert all(t <= v_out for t in r.token_versions)
            assert r.truncated == (r.meta["finish_reason"] != "stop")
            if not r.truncated:
                assert r.response_token_ids[-1] == policy.eos_id
            for w, t in zip(r.loss_weights, r.token_versions):
                assert w == cfg.stale_weight(v_out - t)
            start = 0
            for k, seg_len in enumerate(r.segment_lengths):
                seg = slice(start, start + seg_len)
                assert len(set(r.token_versions[seg])) == 1  # one policy version per segment
                last = k == r.num_segments - 1
                used.append(
                    (
                        r.token_versions[start],
                        tuple(r.prompt_token_ids + r.response_token_ids[:start]),
                        r.response_token_ids[seg],
                        r.behavior_logprobs[seg],
                        last and r.meta["finish_reason"] == "max_response_tokens",
                    )
                )
                start += seg_len
    # Every generator output is used by exactly one segment, in full: segment k of a response came from
    # the context prompt + segments < k. Only a segment that hit the length cap may keep a prefix.
    produced = [(v, ctx, toks, lps) for v, ctx, toks, lps, _ in policy.log]
    assert len(used) == len(produced)
    remaining = Counter((v, ctx, tuple(t), tuple(lp)) for v, ctx, t, lp in produced)
    prefix_cut = []
    for v, ctx, toks, lps, at_cap in used:
        key = (v, ctx, tuple(toks), tuple(lps))
        if remaining[key]:
            remaining[key] -= 1
        else:
            assert at_cap, "a segment that is not a generator output and not cut at the cap"
            prefix_cut.append((v, ctx, toks, lps))
    leftovers = list((+remaining).elements())
    assert len(leftovers) == len(prefix_cut)
    for v, ctx, toks, lps in prefix_cut:  # each cut segment is a strict prefix of one leftover output
        match = next(
            o
            for o in leftovers
            if o[:2] == (v, ctx)
            and list(o[2][: len(toks)]) == toks
            and list(o[3][: len(lps)]) == lps
            and len(o[2]) > len(toks)
        )
        leftovers.remove(match)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cfg=configs,
    group_size=st.integers(1, 3),
    n_prompts=st.integers(1, 5),
    seed=st.integers(0, 10**6),
    interrupt_at=st.integers(0, 6),
)
def test_save_and_load_at_any_iteration_changes_nothing(cfg, group_size, n_prompts, seed, interrupt_at):
    baseline, v_base, _ = _drain(cfg, group_size, n_prompts, seed)
    resumed, v_res, _ = _drain(cfg, group_size, n_prompts, seed, interrupt_at=interrupt_at)
    assert [asdict(g) for g in resumed] == [asdict(g) for g in baseline]
    assert v_res == v_base
