"""MLflow on the NeMo-RL path through faults, through the installed NeMo-RL's real Logger/MLflowLogger: an
outage of a real `mlflow server` during a run loses and duplicates nothing, and a server lost while
NeMo-RL sets up costs nothing (the journal's rules without NeMo-RL: tests/unit/test_tracking_nemo_rl_faults.py)."""

from __future__ import annotations

import shutil

import pytest
from mlflow.tracking import MlflowClient

from bapo_nemo.tracking.nemo_rl import (
    after_setup,
    finish_nemo_tracking,
)
from tests.support.mlflow_server import MlflowServer
from tests.support.nemo_tracking import attempt_config, checkpoint, steps_of


@pytest.fixture(autouse=True)
def _a_live_server_may_answer_slowly(monkeypatch):
    """As in tests/unit/test_tracking_mlflow.py: the outages here are a stopped server, refused at once."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")


@pytest.fixture
def server(tmp_path, template_db):
    srv = MlflowServer(tmp_path / "server")
    srv.root.mkdir()
    shutil.copy(template_db, srv.root / "server.db")
    srv.start()
    yield srv
    srv.stop()


def test_server_outage_during_a_run_through_nemo_rl_logger(tmp_path, template_db, server):
    """NeMo-RL's real Logger/MLflowLogger against a real server, stopped after step 2 and restarted after
    step 4 (steps 3-4 and a checkpoint happen during the outage): every step arrives exactly once."""
    import mlflow
    from nemo_rl.utils.logger import Logger

    config = attempt_config(tmp_path, template_db, 1, tracking_uri=server.uri)
    nemo_logger = Logger(config["logger"])
    nemo_logger.log_hyperparams(config)
    tracker = after_setup(config, nemo_logger)
    run_id = tracker.run_id

    def step(number: int) -> None:
        nemo_logger.log_metrics({"reward": number / 10}, number, prefix="train")
        if number % 2 == 0:
            checkpoint(config, number)
        nemo_logger.log_metrics({"loss": -number / 10, "gen": [1, 2, 3]}, number, prefix="train")

    step(1)
    step(2)
    client = MlflowClient(server.uri)
    assert steps_of(client, run_id, "train/reward") == [(1, 0.1), (2, 0.2)]
    server.stop()
    step(3)
    step(4)  # its train metrics find step_4 and try to send steps 3-4: refused, the tracker backs off
    assert [r["step"] for r in tracker.journal.pending if r["kind"] == "metrics"] == [3, 3, 4, 4]
    server.start()
    step(5)  # the tracker is still backing off: journaled only
    assert finish_nemo_tracking(tracker) == [5]
    expected = [(n, n / 10) for n in range(1, 6)]
    assert steps_of(client, run_id, "train/reward") == expected
    assert steps_of(client, run_id, "train/loss") == [(n, -r) for n, r in expected]
    # NeMo-RL's list summary (v0.7.0 and main: _summarize_list) of [1, 2, 3]: mean 2
    assert steps_of(client, run_id, "train/gen/mean") == [(n, 2.0) for n in range(1, 6)]
    assert client.get_run(run_id).info.status == "FINISHED"
    mlflow.end_run()  # NeMo-RL's fluent run, while the server still answers


def test_a_server_lost_while_nemo_rl_sets_up_costs_nothing(tmp_path, template_db, server):
    """NeMo-RL's set-up logs its config and its `timing/setup` metrics straight to MLflow (before the
    journal exists). With the server gone for those calls, set-up goes on; after it the params and the
    step-0 metrics go through the journal and arrive once the server is back."""
    import mlflow
    from nemo_rl.utils.logger import Logger

    config = attempt_config(tmp_path, template_db, 1, tracking_uri=server.uri)
    nemo_logger = Logger(config["logger"])  # NeMo-RL's logger starts its run: it needs the server
    server.stop()
    nemo_logger.log_hyperparams({"policy": {"model_name": "tiny"}, "grpo": {"seed": 7}})
    nemo_logger.log_metrics({"policy_init": 8.25}, 0, prefix="timing/setup")
    server.start()
    tracker = after_setup(config, nemo_logger)
    assert finish_nemo_tracking(tracker) == [0]  # no checkpoint covered step 0 yet: it waited until the end
    client = MlflowClient(server.uri)
    params = client.get_run(tracker.run_id).data.params
    assert params["policy.model_name"] == "tiny" and params["grpo.seed"] == "7"
    assert steps_of(client, tracker.run_id, "timing/setup/policy_init") == [(0, 8.25)]
    mlflow.end_run()
