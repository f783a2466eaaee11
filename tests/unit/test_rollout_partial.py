"""Partial rollouts: hand-computed segments, versions, budgets, caps, stale-segment weights, checkpoint
round trips. Generators are the tiny real ones in test_rollout_generators.py (the model boundary)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest
import torch

from bapo_nemo.rollout import (
    GenerationChunk,
    GenerationOutputError,
    PartialRolloutConfig,
    PartialRolloutConfigError,
    PartialRolloutManager,
    PartialRolloutStateError,
    PromptItem,
)
from tests.support.toy_rollouts import CountdownGenerator, ToyPolicy


def _prompt(pid: str, l0: int, dl: int = 0, **meta) -> PromptItem:
    return PromptItem(prompt_id=pid, token_ids=[l0, dl], meta=meta)


def test_long_response_is_cut_into_budgeted_segments_with_their_versions():
    cfg = PartialRolloutConfig(token_budget=3, max_resumptions=5)
    manager = PartialRolloutManager(cfg, group_size=1)
    gen = CountdownGenerator()
    manager.add_prompts([_prompt("a", 7, answer="42")])
    # 7 tokens at 3 per iteration: 3 (v0) + 3 (v1) + 1 (v2), handed out at v2.
    assert manager.run_iteration(gen.bind(0), 0) == []
    assert manager.run_iteration(gen.bind(1), 1) == []
    (group,) = manager.run_iteration(gen.bind(2), 2)
    (r,) = group.rollouts
    assert r.response_token_ids == [1000, 1001, 1002, 1003, 1004, 1005, 1006]
    assert r.token_versions == [0, 0, 0, 1, 1, 1, 2]
    assert r.segment_lengths == [3, 3, 1] and r.num_segments == 3
    assert r.behavior_logprobs == [-0.01 * (j + 1) for j in range(7)]
    assert r.loss_weights == [1.0] * 7  # stale_segments: keep
    assert r.meta == {
        "answer": "42",
        "truncated": False,
        "finish_reason": "stop",
        "num_segments": 3,
        "sample_index": 0,
    }
    # continuation re-feeds prompt + tokens so far; the budget is passed every time
    assert [(v, ctx, n) for v, ctx, n in gen.calls] == [
        (0, [[7, 0]], 3),
        (1, [[7, 0, 1000, 1001, 1002]], 3),
        (2, [[7, 0, 1000, 1001, 1002, 1003, 1004, 1005]], 3),
    ]


@pytest.mark.parametrize(
    "policy, decay, expected",
    [
        ("keep", 0.5, [1.0] * 7),
        ("exclude", 0.5, [0.0] * 6 + [1.0]),
        # staleness at hand-out (v2): tokens of v0 -> 2, v1 -> 1, v2 -> 0; 0.5**2 = 0.25, 0.5**1 = 0.5
        ("downweight", 0.5, [0.25] * 3 + [0.5] * 3 + [1.0]),
        ("downweight", 0.8, [0.64] * 3 + [0.8] * 3 + [1.0]),
    ],
)
def test_stale_segment_loss_weights(policy, decay, expected):
    cfg = PartialRolloutConfig(token_budget=3, stale_segments=policy, stale_weight_decay=decay)
    manager = PartialRolloutManager(cfg, group_size=1)
    gen = CountdownGenerator()
    manager.add_prompts([_prompt("a", 7)])
    for v in (0, 1):
        manager.run_iteration(gen.bind(v), v)
    (group,) = manager.run_iteration(gen.bind(2), 2)
    assert group.rollouts[0].loss_weights == pytest.approx(expected, abs=1e-15)
    stats = manager.stats(2)
    # staleness per token [2,2,2,1,1,1,0]: mean 9/7, max 2, 6 of 7 from older policies
    assert stats["rollout/staleness_mean"] == pytest.approx(9 / 7)
    assert stats["rollout/staleness_max"] == 2.0
    assert stats["rollout/stale_token_fraction"] == pytest.approx(6 / 7)
    assert stats["rollout/loss_weight_mean"] == pytest.approx(sum(expected) / 7)


def test_weights_are_relative_to_the_version_at_hand_out():
    # A group finished at v0 but handed out at v3 (take_completed) is 3 versions stale.
    cfg = PartialRolloutConfig(token_budget=4, stale_segments="downweight", stale_weight_decay=0.5)
    manager = PartialRolloutManager(cfg, group_size=1)
    manager.add_prompts([_prompt("a", 2), _prompt("b", 2)])
    (first,) = manager.run_iteration(CountdownGenerator().bind(0), 0, max_groups=1)
    assert first.prompt_id == "a" and first.rollouts[0].loss_weights == [1.0, 1.0]
    assert manager.num_completed == 1
    (late,) = manager.take_completed(3)
    assert late.prompt_id == "b" and late.rollouts[0].loss_weights == [0.125, 0.125]  # 0.5**3
    assert manager.stats(3)["rollout/staleness_mean"] == 3.0


def test_resumption_cap_finishes_response_as_truncated():
    cfg = PartialRolloutConfig(token_budget=3, max_resumptions=1)
    manager = PartialRolloutManager(cfg, group_size=1)
    gen = CountdownGenerator()
    manager.add_prompts([_prompt("a", 10)])
    manager.run_iteration(gen.bind(0), 0)
    (group,) = manager.run_iteration(gen.bind(1), 1)
    (r,) = group.rollouts
    # first segment + 1 resumption = 2 segments of 3 tokens, then cut
    assert r.segment_lengths == [3, 3] and len(r.response_token_ids) == 6
    assert r.truncated and r.meta["finish_reason"] == "max_resumptions"
    assert len(gen.calls) == 2
    assert manager.stats(1)["rollout/truncated_fraction"] == 1.0


def test_max_response_tokens_cuts_the_last_segment():
    cfg = PartialRolloutConfig(token_budget=3, max_resumptions=10, max_response_tokens=5)
    manager = PartialRolloutManager(cfg, group_size=1)
    gen = CountdownGenerator()
    manager.add_prompts([_prompt("a", 20)])
    manager.run_iteration(gen.bind(0), 0)
    (group,) = manager.run_iteration(gen.bind(1), 1)
    # 3 tokens, then only 5 - 3 = 2 are asked for
    assert [n for _, _, n in gen.calls] == [3, 2]
    r = group.rollouts[0]
    assert r.segment_lengths == [3, 2] and r.response_token_ids == [1000, 1001, 1002, 1003, 1004]
    assert r.meta["finish_reason"] == "max_response_tokens"


def test_per_prompt_cap_applies_with_the_config_cap():
    cfg = PartialRolloutConfig(token_budget=4, max_response_tokens=9)
    manager = PartialRolloutManager(cfg, group_size=1)
    gen = CountdownGenerator()
    # prompt caps 6 and 20 (config 9 wins for the second): 4+2 and 4+4+1
    manager.add_prompts(
        [
            PromptItem("short", [30, 0], max_response_tokens=6),
            PromptItem("long", [30, 0], max_response_tokens=20),
        ]
    )
    groups = [g for v in range(3) for g in manager.run_iteration(gen.bind(v), v)]
    lengths = {g.prompt_id: g.rollouts[0].segment_lengths for g in groups}
    assert lengths == {"short": [4, 2], "long": [4, 4, 1]}
    # one batched call per iteration, sized for the roomiest response: at iteration 1 "short" (room 2)
    # and "long" (room 4) share a call of 4 and "short" keeps 2 of its 4 tokens; then "long" alone, room 1
    assert [(len(ctxs), n) for _, ctxs, n in gen.calls] == [(2, 4), (2, 4), (1, 1)]
    with pytest.raises(ValueError, match="max_response_tokens must be an int >= 1"):
        manager.add_prompts([PromptItem("bad", [1], max_response_tokens=0)])


def test_only_complete_groups_leave():
    cfg = PartialRolloutConfig(token_budget=2, max_resumptions=10)
    manager = PartialRolloutManager(cfg, group_size=3)
    gen = CountdownGenerator()
    # prompt [1, 2]: samples want 1, 3, 5 tokens -> finished after iterations 1, 2, 3
    manager.add_prompts([_prompt("g", 1, 2)])
    assert manager.run_iteration(gen.bind(0), 0) == []
    assert manager.run_iteration(gen.bind(1), 1) == []
    assert manager.num_in_flight == 1
    (group,) = manager.run_iteration(gen.bind(2), 2)
    assert [len(r.response_token_ids) for r in group.rollouts] == [1, 3, 5]
    assert [r.meta["sample_index"] for r in group.rollouts] == [0, 1, 2]
    # finished samples are not generated again: 3 contexts, then 2, then 1
    assert [len(ctx) for _, ctx, _ in gen.calls] == [3, 2, 1]
    assert manager.num_in_flight == 0


def test_global_budget_schedules_oldest_groups_first():
    cfg = PartialRolloutConfig(token_budget=3, global_token_budget=7)  # 7 // 3 = 2 responses/iteration
    manager = PartialRolloutManager(cfg, group_size=2)
    gen = CountdownGenerator()
    manager.add_prompts([_prompt("a", 3), _prompt("b", 3)])
    (a,) = manager.run_iteration(gen.bind(0), 0)
    assert a.prompt_id == "a" and manager.stats(0)["rollout/tokens_last_iteration"] == 6.0
    (b,) = manager.run_iteration(gen.bind(1), 1)
    assert b.prompt_id == "b" and b.rollouts[0].token_versions == [1, 1, 1]


def test_admission_fills_free_slots_only():
    cfg = PartialRolloutConfig(token_budget=2, max_in_flight_groups=2, prompts_per_iteration=5)
    manager = PartialRolloutManager(cfg, group_size=1)
    gen = CountdownGenerator()
    # "a" needs 4 tokens (2 iterations), the rest 2 tokens (1 iteration)
    manager.add_prompts([_prompt("a", 4), _prompt("b", 2), _prompt("c", 2), _prompt("d", 2)])
    out0 = manager.run_iteration(gen.bind(0), 0)
    assert [g.prompt_id for g in out0] == ["b"] and manager.num_pending == 2  # a, b admitted
    out1 = manager.run_iteration(gen.bind(1), 1)  # one free slot -> c admitted; a and c finish
    assert [g.prompt_id for g in out1] == ["a", "c"] and manager.num_pending == 1
    out2 = manager.run_iteration(gen.bind(2), 2)
    assert [g.prompt_id for g in out2] == ["d"] and manager.num_pending == 0


def test_prompts_per_iteration_limits_new_admissions():
    cfg = PartialRolloutConfig(token_budget=2, prompts_per_iteration=2)
    manager = PartialRolloutManager(cfg, group_size=1)
    manager.add_prompts([_prompt(str(i), 1) for i in range(5)])
    gen = CountdownGenerator()
    assert [g.prompt_id for g in manager.run_iteration(gen.bind(0), 0)] == ["0", "1"]
    assert [g.prompt_id for g in manager.run_iteration(gen.bind(1), 1)] == ["2", "3"]
    assert manager.num_pending == 1


def test_state_round_trip_mid_flight_matches_uninterrupted_run():
    cfg = PartialRolloutConfig(token_budget=3, max_resumptions=3, stale_segments="downweight")
    prompts = [PromptItem(f"p{i}", [1 + i, 2], {"i": i}) for i in range(6)]

    def run(interrupt_at: int | None):
        policy = ToyPolicy(seed=11, eos_logit_bias=-0.5)
        manager = PartialRolloutManager(cfg, group_size=3)
        out = []
        for v in range(8):
            if v in (0, 2):
                manager.add_prompts(prompts[v * 3 // 2 : v * 3 // 2 + 3])
            if v == interrupt_at:
                saved = json.loads(json.dumps(manager.state_dict()))  # through JSON, as on disk
                assert saved["active"], "the interruption must fall while segments are in flight"
                manager = PartialRolloutManager(cfg, group_size=3)
                manager.load_state_dict(saved)
            out.extend(asdict(g) for g in manager.run_iteration(policy.bind(v), v))
        return out, manager.stats(7)

    baseline, baseline_stats = run(None)
    assert sum(len(g["rollouts"]) for g in baseline) > 0
    for k in (1, 2, 3):
        resumed, resumed_stats = run(k)
        assert resumed == baseline
        assert resumed_stats == baseline_stats


def test_state_dict_mid_flight_has_segments_in_flight():
    cfg = PartialRolloutConfig(token_budget=2)
    manager = PartialRolloutManager(cfg, group_size=1)
    manager.add_prompts([_prompt("a", 5)])
    manager.run_iteration(CountdownGenerator().bind(4), 4)
    state = manager.state_dict()
    (seq,) = state["active"][0]["sequences"]
    assert seq["response_token_ids"] == [1000, 1001] and seq["segment_versions"] == [4]
    assert state["last_version"] == 4


@pytest.mark.parametrize(
    "change, field",
    [
        ({"token_budget": 4}, "token_budget"),
        ({"max_resumptions": 2}, "max_resumptions"),
        ({"max_response_tokens": 9}, "max_response_tokens"),
    ],
)
def test_incompatible_state_names_the_field(change, field):
    cfg = PartialRolloutConfig(token_budget=2, max_resumptions=3)
    manager = PartialRolloutManager(cfg, group_size=2)
    manager.add_prompts([_prompt("a", 5)])
    manager.run_iteration(CountdownGenerator(), 0)
    state = manager.state_dict()
    other = PartialRolloutManager(cfg.model_copy(update=change), group_size=2)
    with pytest.raises(PartialRolloutStateError, match=rf"config\.{field}"):
        other.load_state_dict(state)


def test_group_size_mismatch_and_malformed_state_are_named():
    cfg = PartialRolloutConfig(token_budget=2)
    manager = PartialRolloutManager(cfg, group_size=2)
    manager.add_prompts([_prompt("a", 5)])
    manager.run_iteration(CountdownGenerator(), 0)
    state = manager.state_dict()
    with pytest.raises(PartialRolloutStateError, match="group_size is 2 but this run uses group_size=4"):
        PartialRolloutManager(cfg, group_size=4).load_state_dict(state)
    broken = json.loads(json.dumps(state))
    broken["active"][0]["sequences"][0]["segment_versions"].append(0)
    with pytest.raises(PartialRolloutStateError, match=r"active\[0\]\.sequences\[0\].*disagree"):
        PartialRolloutManager(cfg, group_size=2).load_state_dict(broken)
    broken = json.loads(json.dumps(state))
    broken["active"][0]["sequences"][0]["response_token_ids"] = "oops"
    with pytest.raises(PartialRolloutStateError, match=r"active\.0\.sequences\.0\.response_token_ids"):
        PartialRolloutManager(cfg, group_size=2).load_state_dict(broken)
    # non-binding settings may change on resume (admission, stale policy)
    relaxed = PartialRolloutManager(cfg.model_copy(update={"stale_segments": "exclude"}), group_size=2)
    relaxed.load_state_dict(state)
    assert relaxed.num_in_flight == 1


def test_contract_violations_by_the_generator_are_reported():
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=2), group_size=1)
    manager.add_prompts([_prompt("a", 5)])
    with pytest.raises(GenerationOutputError, match="max_new_tokens was 2"):
        manager.run_iteration(lambda ctxs, n: [GenerationChunk([1, 2, 3], [-1.0] * 3, False)], 0)
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=2), group_size=1)
    manager.add_prompts([_prompt("a", 5)])
    with pytest.raises(GenerationOutputError, match="1 token_ids but 0 logprobs"):
        manager.run_iteration(lambda ctxs, n: [GenerationChunk([1], [], False)], 0)
    with pytest.raises(GenerationOutputError, match="non-finite"):
        manager.run_iteration(lambda ctxs, n: [GenerationChunk([1], [math.nan], False)], 0)
    with pytest.raises(GenerationOutputError, match="0 chunks for 1 contexts"):
        manager.run_iteration(lambda ctxs, n: [], 0)


def test_bad_inputs_are_rejected_with_the_field():
    with pytest.raises(PartialRolloutConfigError, match="partial_rollouts.token_budget: required"):
        PartialRolloutConfig.parse({})
    with pytest.raises(PartialRolloutConfigError, match="stale_weight_decay must be in"):
        PartialRolloutConfig.parse({"token_budget": 4, "stale_weight_decay": 0})
    with pytest.raises(PartialRolloutConfigError, match="unknown key"):
        PartialRolloutConfig.parse({"token_budget": 4, "budget": 3})
    with pytest.raises(PartialRolloutConfigError, match="global_token_budget"):
        PartialRolloutConfig.parse({"token_budget": 4, "global_token_budget": 3})
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=2), group_size=1)
    with pytest.raises(ValueError, match=r"prompt_id='x'.*JSON"):
        manager.add_prompts([PromptItem("x", [1], {"obj": object()})])
    with pytest.raises(ValueError, match="non-empty list of ints"):
        manager.add_prompts([PromptItem("y", [], {})])
    with pytest.raises(ValueError, match=r"prompts\[1\].*non-empty list of ints"):
        manager.add_prompts([_prompt("ok", 2), PromptItem("z", [1.5], {})])
    assert manager.num_pending == 0  # a bad prompt queues none of the batch
    manager.add_prompts([PromptItem("t", torch.tensor([3, 4]).tolist() + list(torch.tensor([5])), {})])
    assert manager.num_pending == 1  # torch integer scalars are accepted as ints
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=2), group_size=1)
    manager.add_prompts([_prompt("a", 3)])
    manager.run_iteration(CountdownGenerator(), 5)
    with pytest.raises(ValueError, match="went backwards"):
        manager.run_iteration(CountdownGenerator(), 4)


def test_stats_cover_every_hand_out_of_one_version():
    # a step that takes a waiting group and then generates: both count in the step's statistics
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=2), group_size=1)
    gen = CountdownGenerator()
    manager.add_prompts([_prompt("a", 2), _prompt("b", 2)])
    manager.run_iteration(gen.bind(0), 0, max_groups=1)  # "a" out, "b" complete and waiting (2 tokens, v0)
    manager.add_prompts([_prompt("c", 2)])
    assert [g.prompt_id for g in manager.take_completed(1, max_groups=1)] == ["b"]
    assert [g.prompt_id for g in manager.run_iteration(gen.bind(1), 1)] == ["c"]
    stats = manager.stats(1)
    # b: 2 tokens of v0 (staleness 1); c: 2 tokens of v1 (staleness 0) -> mean 0.5, half stale
    assert stats["rollout/returned_groups"] == 2.0 and stats["rollout/returned_tokens"] == 4.0
    assert stats["rollout/staleness_mean"] == 0.5 and stats["rollout/stale_token_fraction"] == 0.5
    assert stats["rollout/segments_hist/1"] == 3.0
