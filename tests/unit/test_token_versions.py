"""Per-token policy versions under in-flight weight updates: the engine-side tracker, the trainer-side join,
the ages, and the driver's checks. Expectations by hand; the worker subclass on vLLM's real AsyncLLM is
tests/nemo_rl/test_vllm_inflight_update.py."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from bapo_nemo.nemo import token_versions as adapter
from bapo_nemo.rollout.token_versions import (
    UNKNOWN,
    VersionIndex,
    VersionTracker,
    fingerprint,
    spans,
    token_ages,
)


def test_a_request_crossing_an_update_splits_at_the_tokens_it_had_streamed():
    tracker = VersionTracker()
    tracker.started("a", [1, 2])
    tracker.streamed("a", 3)
    tracker.update_sent()
    tracker.streamed("a", 4)  # produced before the engine applied the update, streamed after it was sent
    tracker.update_applied()
    tracker.started("b", [1, 3])  # after the update: all on the new weights
    tracker.streamed("a", 6)
    tracker.finished("a", [5, 6, 7, 8, 9, 10])
    tracker.streamed("b", 2)
    tracker.finished("b", [4, 4])
    taken = tracker.take()
    assert taken["updates"] == 1
    assert taken["records"] == [
        {"key": fingerprint([1, 2], [5, 6, 7, 8, 9, 10]), "runs": [[0, 0], [3, 1]]},
        {"key": fingerprint([1, 3], [4, 4]), "runs": [[0, 1]]},
    ]
    assert tracker.take() == {"updates": 1, "records": []}


def test_a_failed_update_and_one_after_the_last_token_leave_one_version():
    tracker = VersionTracker()
    tracker.started("a", [1])
    tracker.streamed("a", 2)
    tracker.update_sent()
    tracker.update_failed()
    tracker.streamed("a", 3)
    tracker.update_sent()  # the request had streamed all its tokens: its end is only not reported yet
    tracker.update_applied()
    tracker.finished("a", [7, 8, 9])
    tracker.started("c", [2])
    tracker.abandoned("c")  # a cancelled request leaves no record
    assert tracker.take() == {
        "updates": 1,
        "records": [{"key": fingerprint([1], [7, 8, 9]), "runs": [[0, 0]]}],
    }


def test_two_updates_inside_one_response():
    tracker = VersionTracker()
    tracker.started("a", [9])
    for n, update in [(2, True), (5, True), (7, False)]:
        tracker.streamed("a", n)
        if update:
            tracker.update_sent()
            tracker.update_applied()
    tracker.finished("a", list(range(7)))
    assert tracker.take()["records"][0]["runs"] == [[0, 0], [2, 1], [5, 2]]


def test_the_engines_counts_place_each_boundary_where_it_applied_the_update():
    """With the engine's generated-token counts (read inside the engine when it applied the update), a
    request is split there, not at what had streamed; a request the engine no longer held had finished
    (all old) if any of it had streamed, else had not started (all new). Engine ids carry vLLM's suffix."""
    tracker = VersionTracker()
    for request, prompt in (("a", [1]), ("b", [2]), ("c", [3]), ("d", [4])):
        tracker.started(request, prompt)
    tracker.streamed("a", 1)
    tracker.streamed("b", 2)
    tracker.update_sent()
    tracker.generated_at_update({"a-0f1e2d3c": 4, "d": 0, "z-00000000": 9})  # z: another worker's request
    tracker.update_applied()
    tracker.finished("a", [10, 11, 12, 13, 14, 15])
    tracker.finished("b", [20, 21, 22])  # ran to its end before the update; 2 of 3 tokens had streamed
    tracker.finished("c", [30, 31])  # submitted, not yet scheduled when the update was applied
    tracker.finished("d", [40])
    runs = {r["key"]: r["runs"] for r in tracker.take()["records"]}
    assert runs == {
        fingerprint([1], [10, 11, 12, 13, 14, 15]): [[0, 0], [4, 1]],
        fingerprint([2], [20, 21, 22]): [[0, 0]],
        fingerprint([3], [30, 31]): [[0, 1]],
        fingerprint([4], [40]): [[0, 1]],
    }


def test_an_update_without_the_engines_counts_splits_at_what_had_streamed():
    tracker = VersionTracker()
    tracker.started("a", [1])
    tracker.streamed("a", 2)
    tracker.update_sent()
    tracker.generated_at_update({"a": 5})
    tracker.update_failed()  # those counts belonged to the failed update
    tracker.update_sent()
    tracker.update_applied()
    tracker.finished("a", [1, 2, 3, 4, 5, 6])
    assert tracker.take()["records"][0]["runs"] == [[0, 0], [2, 1]]


def test_a_vllm_worker_without_its_request_cache_stops_the_run():
    class Worker:  # what collective_rpc hands the function: vLLM's worker, here one without a model runner
        def update_weights_via_ipc_zmq(self):
            return True

    with pytest.raises(adapter.TokenVersionsError, match="model_runner.requests"):
        adapter.update_and_count_generated(Worker(), "update_weights_via_ipc_zmq")


def test_spans_from_runs():
    assert spans([[0, 4], [3, 5]], 7) == [[3, 4], [4, 5]]
    assert spans([[0, 4]], 2) == [[2, 4]]


def test_fingerprints_agree_between_lists_and_tensors():
    ids = torch.tensor([5, 6, 7, 8])
    assert fingerprint([5, 6], [7, 8]) == fingerprint(ids[:2].numpy(), ids[2:].numpy())
    assert fingerprint([5, 6], [7, 8]) != fingerprint([5], [6, 7, 8])  # the context is part of the key


def test_the_index_joins_records_with_a_multi_turn_row_and_consumes_them():
    # prompt (3) | response 1 (4, crossed an update after 1 token) | env tokens (2) | response 2 (2, no record)
    row = np.array([1, 2, 3, 10, 11, 12, 13, 4, 5, 20, 21, 0, 0])
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0])
    index = VersionIndex()
    index.add([{"key": fingerprint([1, 2, 3], [10, 11, 12, 13]), "runs": [[0, 2], [1, 3]]}])
    assert index.row_spans(row[:11], mask[:11]) == [[1, 2], [3, 3], [2, UNKNOWN]]
    assert len(index) == 0
    assert index.row_spans(row[:11], mask[:11]) == [[6, UNKNOWN]]


def test_identical_responses_each_take_one_record():
    # two samples of one prompt came out identical, one before an update and one across it
    key = fingerprint([1, 2], [7, 8, 9])
    index = VersionIndex()
    index.add([{"key": key, "runs": [[0, 0]]}, {"key": key, "runs": [[0, 0], [2, 1]]}])
    row, mask = np.array([1, 2, 7, 8, 9]), np.array([0, 0, 1, 1, 1])
    got = [index.row_spans(row, mask), index.row_spans(row, mask), index.row_spans(row, mask)]
    assert got == [[[3, 0]], [[2, 0], [1, 1]], [[3, UNKNOWN]]]


def test_the_index_forgets_records_too_old_to_be_trained():
    index = VersionIndex()
    index.add([{"key": "old", "runs": [[0, 1], [4, 2]]}, {"key": "new", "runs": [[0, 3]]}])
    index.forget_older_than(3)
    assert len(index) == 1


def test_token_ages_by_hand():
    # trained version 7: a response of 3 tokens at v5 then 2 at v6; one of 4 at v7; 1 unknown token
    ages = token_ages([[[3, 5], [2, 6]], [[4, 7], [1, UNKNOWN]]], 7)
    assert ages.mean == pytest.approx((3 * 2 + 2 * 1 + 4 * 0) / 9)
    assert ages.max == 2
    assert ages.mixed_response_frac == 0.5
    assert ages.known_token_frac == pytest.approx(9 / 10)


# ---- the worker subclass ----------------------------------------------------------------------------
class WorkerWithoutEngine:
    """A worker of a tensor-parallel group that does not own the engine (NeMo-RL leaves its `llm` None).
    The subclass around a worker that owns vLLM's AsyncLLM runs in tests/nemo_rl/test_vllm_inflight_update.py."""

    llm = None


def test_a_worker_without_the_engine_says_it_does_not_own_one():
    fqn = adapter.versioned_worker_fqn(f"{__name__}.WorkerWithoutEngine")
    module, name = fqn.rsplit(".", 1)
    assert module == adapter.__name__
    worker = getattr(adapter, name).__ray_actor_class__()  # built as Ray builds it in a worker: by name
    taken = asyncio.run(worker.take_token_versions())
    assert taken == {"updates": 0, "records": [], "owner": False}


def test_policy_versions_of_update_counts_and_the_step_metrics(tmp_path):
    versions = adapter.TokenVersions(max_trajectory_age_steps=2)
    versions.start_step, versions.refit_versions = 4, [4, 5]  # resumed at step 4: refits carried v4, v5
    assert [versions.policy_version(c) for c in (0, 1, 2, 3)] == [UNKNOWN, 4, 5, UNKNOWN]
    versions.trained_steps = 1  # training version 5
    prompt, response = [1, 2], [10, 11, 12, 13]
    versions.index.add([{"key": fingerprint(prompt, response), "runs": [[0, 0], [1, 1], [3, 2]]}])
    data = {
        "input_ids": torch.tensor([[1, 2, 10, 11, 12, 13, 0]]),
        "token_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 0]]),
        "input_lengths": torch.tensor([6]),
    }
    versions.record_path = tmp_path / "logs" / "token_versions.jsonl"
    metrics = versions.step_metrics(data)
    # 1 token from the engine's own weights (unknown), 2 from v4 (age 1), 1 from v5 (age 0)
    assert metrics["token_frac_engine_initial_weights"] == pytest.approx(1 / 4)
    assert metrics["token_version_known_frac"] == pytest.approx(3 / 4)
    assert metrics["token_age_mean"] == pytest.approx(2 / 3)
    assert metrics["token_age_max"] == 1.0
    assert metrics["mixed_version_response_frac"] == 1.0
    (line,) = versions.record_path.read_text().splitlines()
    assert json.loads(line) == {"trained_version": 5, "spans": [[[1, UNKNOWN], [2, 4], [1, 5]]]}


def test_a_worker_that_missed_an_update_stops_the_run():
    versions = adapter.TokenVersions(max_trajectory_age_steps=1)
    versions.refit_versions = [0, 1]
    record = {"key": "k", "runs": [[0, 1]]}
    versions.add_answers(
        [
            {"owner": False, "updates": 0, "records": []},  # a TP rank without the engine
            {"owner": True, "updates": 2, "records": [record]},
        ]
    )
    assert len(versions.index) == 1
    with pytest.raises(
        adapter.TokenVersionsError, match="applied 1 weight updates where the async loop made 2"
    ):
        versions.add_answers([{"owner": True, "updates": 1, "records": []}])
