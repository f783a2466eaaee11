"""MLflow on the NeMo-RL path through faults: a step's metrics go to MLflow only once a complete checkpoint
covers the step, the journal lives beside the checkpoints, a requeued attempt sets aside what an earlier
attempt logged for steps it runs again, and an outage of a real `mlflow server` loses and duplicates
nothing. These tests stand in for NeMo-RL's logger (tests/support/nemo_tracking.py); with the real
Logger/MLflowLogger: tests/nemo_rl/test_tracking_faults.py.

A "step" below follows the order of NeMo-RL's sync loop (grpo_train, both trees): the rollout metrics of
step S, then the checkpoint (``tmp_step_S`` renamed to ``step_S`` when complete; on main possibly later, on
a background thread), then the step's train and timing metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_nemo.tracking.mlflow_tracker import MlflowTracker
from bapo_nemo.tracking.nemo_rl import (
    JOURNAL_DIR,
    after_setup,
    finish_nemo_tracking,
    journal_dir,
)
from tests.support.nemo_tracking import (
    StandInLogger,
    attempt_config,
    checkpoint,
    complete,
    steps_of,
)


@pytest.fixture(autouse=True)
def _a_live_server_may_answer_slowly(monkeypatch):
    """As in tests/unit/test_tracking_mlflow.py: the outages here are a stopped server, refused at once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")


def test_a_step_goes_to_mlflow_once_a_complete_checkpoint_covers_it(tmp_path, template_db):
    config = attempt_config(tmp_path, template_db, 1)
    nemo_logger = StandInLogger(config["logger"])
    tracker = after_setup(config, nemo_logger, resumed_step=0)
    backend, run_id = nemo_logger.loggers[0], nemo_logger.loggers[0].run_id
    client = MlflowClient(config["logger"]["mlflow"]["tracking_uri"])

    backend.log_metrics({"reward": 0.25}, 1, prefix="train")
    tracker.log_tags({"note": "after step 1's metrics"})  # no step: waits in its place behind them
    # the GPU monitor's steps are seconds since it started (it passes step_metric): never held
    backend.log_metrics({"gpu0": {"util": 0.9}, "ray_step": 3600}, 3600, prefix="ray", step_metric="ray/ray_step")
    assert steps_of(client, run_id, "train/reward") == []
    assert "note" not in client.get_run(run_id).data.tags
    checkpoint(config, 1, complete=False)  # tmp_step_1: written, not complete
    assert tracker.flush() == 3
    assert steps_of(client, run_id, "train/reward") == []
    complete(config, 1)
    assert tracker.flush() == 0
    assert steps_of(client, run_id, "train/reward") == [(1, 0.25)]
    assert client.get_run(run_id).data.tags["note"] == "after step 1's metrics"
    assert steps_of(client, run_id, "ray/gpu0/util") == [(3600, 0.9)]

    backend.log_metrics({"reward": 0.5}, 2, prefix="train")
    backend.log_metrics({"reward": 0.75}, 3, prefix="train")
    checkpoint(config, 2)  # covers step 2, not step 3
    assert tracker.flush() == 1
    assert steps_of(client, run_id, "train/reward") == [(1, 0.25), (2, 0.5)]
    # a clean end sends what no checkpoint covers, and names it
    assert finish_nemo_tracking(tracker) == [3]
    assert steps_of(client, run_id, "train/reward") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_the_gate_is_asked_once_per_send_and_only_when_a_record_waits(tmp_path, template_db):
    """The checkpoint directory is listed at most once per send attempt, and not at all while every
    record's step is covered by the newest answer (on Lustre a listing per metric would add up)."""
    shutil.copy(template_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    asked = []

    def newest_checkpoint() -> int:
        asked.append(1)
        return 5

    tracker = MlflowTracker(uri, "gate", buffer_dir=tmp_path / "journal", sendable_step=newest_checkpoint)
    tracker.start({}, {})  # params and tags: no step, never held
    assert asked == []
    for step in range(1, 6):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert len(asked) == 1  # the first answer (5) covers steps 1-5
    for step in (6, 7):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert len(asked) == 3  # one listing per send attempt while step 6 waits
    assert tracker.held_steps() == [6, 7]
    assert [m.step for m in MlflowClient(uri).get_metric_history(tracker.run_id, "loss")] == [1, 2, 3, 4, 5]


def test_requeued_attempt_sets_aside_the_steps_it_runs_again(tmp_path, template_db, caplog):
    """Attempt 1 checkpoints step 2, logs steps 3-5 with step 4's checkpoint renamed late (main renames on a
    background thread) and dies: its tracker is dropped without finish, steps 3-5 journaled and unsent.
    Attempt 2 (the same command: the next exp_NNN, resumed from step_4) replays steps 3-4, sets step 5
    aside and runs 5-6. MLflow ends with each step once, step 5 from attempt 2."""
    first = attempt_config(tmp_path, template_db, 1)
    logger_1 = StandInLogger(first["logger"])
    tracker_1 = after_setup(first, logger_1, resumed_step=0)
    backend, run_id = logger_1.loggers[0], logger_1.loggers[0].run_id

    def step(backend, number: int, attempt: int, save: bool, config: dict, rename: bool = True) -> None:
        backend.log_metrics({"reward": number + attempt / 10}, number, prefix="train")  # rollout metrics
        if save:
            checkpoint(config, number, complete=rename)
        backend.log_metrics({"loss": -number - attempt / 10}, number, prefix="train")  # train metrics
        backend.log_metrics({"total_step_time": 1.0}, number, prefix="timing/train", step_finished=True)

    step(backend, 1, 1, False, first)
    step(backend, 2, 1, True, first)
    step(backend, 3, 1, False, first)
    step(backend, 4, 1, True, first, rename=False)  # tmp_step_4 written; the rename still to come
    backend.log_metrics({"reward": 5.1}, 5, prefix="train")  # step 5's rollout metrics
    complete(first, 4)  # the background rename lands; the process is killed before its next log call
    client = MlflowClient(first["logger"]["mlflow"]["tracking_uri"])
    assert steps_of(client, run_id, "train/reward") == [(1, 1.1), (2, 2.1)]
    assert [r["step"] for r in tracker_1.journal.pending] == [3, 3, 3, 4, 4, 4, 5]  # on disk, unsent
    del tracker_1, backend, logger_1

    second = attempt_config(tmp_path, template_db, 2)
    assert second["logger"]["mlflow"]["run_id"] == run_id  # step_4 exists: the same run goes on
    assert second["logger"]["log_dir"] != first["logger"]["log_dir"]
    logger_2 = StandInLogger(second["logger"])
    with caplog.at_level("WARNING"):
        tracker_2 = after_setup(second, logger_2, resumed_step=4)
    superseded = Path(first["checkpointing"]["checkpoint_dir"]) / JOURNAL_DIR / f"{run_id}.superseded.jsonl"
    assert (f"1 metric record of step 5, logged by an earlier attempt after checkpoint step_4, set aside in "
            f"{superseded}: those steps are run again") in caplog.text
    assert steps_of(client, run_id, "train/reward") == [(1, 1.1), (2, 2.1), (3, 3.1), (4, 4.1)]
    step(logger_2.loggers[0], 5, 2, False, second)
    step(logger_2.loggers[0], 6, 2, True, second)
    assert finish_nemo_tracking(tracker_2) == []

    assert steps_of(client, run_id, "train/reward") == [(1, 1.1), (2, 2.1), (3, 3.1), (4, 4.1), (5, 5.2), (6, 6.2)]
    assert steps_of(client, run_id, "train/loss") == [(1, -1.1), (2, -2.1), (3, -3.1), (4, -4.1), (5, -5.2),
                                                       (6, -6.2)]
    assert [s for s, _ in steps_of(client, run_id, "timing/train/total_step_time")] == [1, 2, 3, 4, 5, 6]
    (aside,) = [json.loads(line) for line in superseded.read_text().splitlines()]
    assert aside["step"] == 5 and aside["metrics"] == {"train/reward": 5.1}


def test_steps_of_a_checkpoint_found_damaged_stay_as_the_attempt_that_completed_it_logged_them(tmp_path, template_db):
    """Attempt 1 completes step_2 (its train metrics still journaled: main renames late) and dies in step 3.
    step_2 is then found damaged: attempt 2 resumes from step_1 and runs step 2 again. MLflow keeps attempt
    1's step 2 (its journaled records go out now), attempt 2's step 2 is kept aside; step 3 is attempt 2's."""
    first = attempt_config(tmp_path, template_db, 1)
    logger_1 = StandInLogger(first["logger"])
    tracker_1 = after_setup(first, logger_1, resumed_step=0)
    backend, run_id = logger_1.loggers[0], logger_1.loggers[0].run_id
    for number in (1, 2):
        backend.log_metrics({"reward": number + 0.1}, number, prefix="train")
        checkpoint(first, number, complete=number == 1)  # step_2's rename still to come
        backend.log_metrics({"loss": -number - 0.1}, number, prefix="train")
    backend.log_metrics({"reward": 3.1}, 3, prefix="train")
    complete(first, 2)  # the rename lands; the process dies before its next log call
    client = MlflowClient(first["logger"]["mlflow"]["tracking_uri"])
    assert steps_of(client, run_id, "train/loss") == [(1, -1.1)]
    del tracker_1, backend, logger_1

    second = attempt_config(tmp_path, template_db, 2)
    logger_2 = StandInLogger(second["logger"])
    tracker_2 = after_setup(second, logger_2, resumed_step=1, logged_through=2)
    assert steps_of(client, run_id, "train/loss") == [(1, -1.1), (2, -2.1)]  # attempt 1's, sent now
    backend = logger_2.loggers[0]
    for number in (2, 3):
        backend.log_metrics({"reward": number + 0.2}, number, prefix="train")
        if number == 3:  # step 2 was saved again (the damaged step_2 moved aside): step_2 stands
            checkpoint(second, number)
        backend.log_metrics({"loss": -number - 0.2}, number, prefix="train")
    assert finish_nemo_tracking(tracker_2) == []
    assert steps_of(client, run_id, "train/reward") == [(1, 1.1), (2, 2.1), (3, 3.2)]
    assert steps_of(client, run_id, "train/loss") == [(1, -1.1), (2, -2.1), (3, -3.2)]
    superseded = Path(first["checkpointing"]["checkpoint_dir"]) / JOURNAL_DIR / f"{run_id}.superseded.jsonl"
    aside = [(r["step"], r["metrics"]) for r in map(json.loads, superseded.read_text().splitlines())]
    assert aside == [(3, {"train/reward": 3.1}), (2, {"train/reward": 2.2}), (2, {"train/loss": -2.2})]


def test_every_attempt_finds_the_journal_beside_the_checkpoints(tmp_path, template_db):
    first, second = (attempt_config(tmp_path, template_db, n) for n in (1, 2))
    assert first["logger"]["log_dir"] != second["logger"]["log_dir"]
    expected = Path(first["checkpointing"]["checkpoint_dir"]) / JOURNAL_DIR
    assert journal_dir(first) == journal_dir(second) == expected
    tracker = after_setup(first, StandInLogger(first["logger"]))
    assert tracker.journal.path.parent == expected
    # without checkpointing nothing resumes: the journal stays with the attempt's logs
    first["checkpointing"]["enabled"] = False
    assert journal_dir(first) == Path(first["logger"]["log_dir"]) / "mlflow_buffer"


