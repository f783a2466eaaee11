"""Sample replay: staleness bound, oldest-first eviction, checkpoint round trip, mini-batch split."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_nemo.rollout import (
    PartialRolloutConfig,
    PartialRolloutManager,
    PromptItem,
    ReplayBuffer,
    ReplayStateError,
    split_minibatches,
)
from tests.support.toy_rollouts import CountdownGenerator


def test_capacity_evicts_oldest_and_staleness_bound_holds():
    buf = ReplayBuffer(capacity=3, max_staleness=1)
    buf.add(["a", "b"], policy_version=0)
    buf.add(["c"], policy_version=1)
    buf.add(["d"], policy_version=2)  # 4 items > capacity 3: "a" (v0, added first) goes
    assert sorted(buf.sample(10, current_version=1, generator=torch.Generator().manual_seed(0))) == [
        "b",
        "c",
        "d",
    ]
    assert buf.evicted_capacity == 1
    # at version 2 with max_staleness 1: v0 is 2 versions old -> evicted; v1 and v2 stay
    got = buf.sample(10, current_version=2, generator=random.Random(0))
    assert sorted(got) == ["c", "d"] and buf.evicted_stale == 1 and len(buf) == 2
    assert buf.evict_stale(current_version=4) == 2 and len(buf) == 0
    assert buf.sample(3, current_version=4) == []


def test_sample_is_without_replacement_and_items_stay_for_reuse():
    buf = ReplayBuffer(capacity=10, max_staleness=5)
    buf.add(list(range(6)), policy_version=0)
    g = torch.Generator().manual_seed(1)
    first = buf.sample(4, current_version=0, generator=g)
    assert len(first) == 4 and len(set(first)) == 4
    assert len(buf) == 6  # sampling does not consume
    # the same generator seed gives the same sample
    assert buf.sample(4, 0, torch.Generator().manual_seed(1)) == first


@settings(max_examples=50, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=15),
    capacity=st.integers(1, 6),
    max_staleness=st.integers(0, 3),
)
def test_never_returns_an_item_older_than_max_staleness(ops, capacity, max_staleness):
    buf = ReplayBuffer(capacity=capacity, max_staleness=max_staleness)
    reference: list[tuple[int, int]] = []  # independent model: items in add order
    for version, (n_add, n_sample) in enumerate(ops):
        items = [(version, i) for i in range(n_add)]
        buf.add(items, policy_version=version)
        reference.extend(items)
        reference = reference[max(0, len(reference) - capacity) :]  # versions only grow: oldest = first
        assert len(buf) <= capacity
        got = buf.sample(n_sample, version, random.Random(version))
        reference = [it for it in reference if version - it[0] <= max_staleness]
        for item_version, _ in got:
            assert version - item_version <= max_staleness
        assert set(got) <= set(reference) and len(got) == min(n_sample, len(reference))


def test_state_round_trip_with_rollout_groups():
    manager = PartialRolloutManager(PartialRolloutConfig(token_budget=4), group_size=2)
    manager.add_prompts([PromptItem("a", [2, 1], {"answer": 3})])
    groups = manager.run_iteration(CountdownGenerator(), 0)
    buf = ReplayBuffer(capacity=4, max_staleness=2)
    buf.add(groups, policy_version=0)
    buf.add([{"plain": [1, 2]}], policy_version=1)
    state = json.loads(json.dumps(buf.state_dict()))
    restored = ReplayBuffer(capacity=4, max_staleness=2)
    restored.load_state_dict(state)
    assert restored.versions() == [0, 1]
    got = restored.sample(2, current_version=1, generator=torch.Generator().manual_seed(0))
    assert sorted(map(repr, got)) == sorted(map(repr, groups + [{"plain": [1, 2]}]))
    assert restored.state_dict() == buf.state_dict()


def test_bad_arguments_and_states_are_named():
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=0, max_staleness=1)
    with pytest.raises(ValueError, match="max_staleness"):
        ReplayBuffer(capacity=2, max_staleness=-1)
    with pytest.raises(ValueError, match="eviction"):
        ReplayBuffer(capacity=2, max_staleness=1, eviction="random")
    buf = ReplayBuffer(capacity=2, max_staleness=1)
    buf.add([object()], 0)
    with pytest.raises(TypeError, match="item 0 .*not JSON-serialisable"):
        buf.state_dict()
    big = ReplayBuffer(capacity=3, max_staleness=1)
    big.add([1, 2, 3], 0)
    with pytest.raises(ReplayStateError, match="capacity is 2"):
        ReplayBuffer(capacity=2, max_staleness=1).load_state_dict(big.state_dict())
    with pytest.raises(ReplayStateError, match="entries"):
        ReplayBuffer(capacity=2, max_staleness=1).load_state_dict({"next_seq": 0})


def test_split_minibatches_keeps_groups_whole():
    # 8 items in groups of 2 -> 4 groups over 3 updates: 2 + 1 + 1 groups
    assert split_minibatches(8, 3, group_size=2) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert split_minibatches(6, 2) == [[0, 1, 2], [3, 4, 5]]
    shuffled = split_minibatches(8, 2, group_size=2, generator=torch.Generator().manual_seed(0))
    flat = sorted(i for mb in shuffled for i in mb)
    assert flat == list(range(8)) and all(len(mb) == 4 for mb in shuffled)
    for mb in shuffled:  # each group's two samples stay adjacent: (2k, 2k+1)
        assert all(mb[j] % 2 == 0 and mb[j + 1] == mb[j] + 1 for j in range(0, len(mb), 2))
    with pytest.raises(ValueError, match="updates_per_batch must be between 1 and the number of groups"):
        split_minibatches(4, 3, group_size=2)
    with pytest.raises(ValueError, match="multiple of group_size"):
        split_minibatches(5, 1, group_size=2)
