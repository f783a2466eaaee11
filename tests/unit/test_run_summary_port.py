"""The end-of-run `mlflow ui` line names the port the command it prints serves on: MLFLOW_PORT (which
`mlflow ui` reads) when set, else 5000, said in the command itself so the two cannot disagree."""

from __future__ import annotations

import pytest

from bapo_nemo.embedded.output.run_summary import look_commands

RECORD = {"mlflow_tracking_uri": "sqlite:///runs/local_cpu/mlflow.db"}


@pytest.mark.parametrize(("env", "port"), [(None, 5000), ("5123", 5123), ("not-a-port", 5000)])
def test_mlflow_ui_line_serves_and_opens_the_same_port(monkeypatch, env, port):
    if env is None:
        monkeypatch.delenv("MLFLOW_PORT", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_PORT", env)
    line = look_commands(RECORD, "bapo-embedded", "1")[0]
    assert line == (f"mlflow ui --backend-store-uri sqlite:///runs/local_cpu/mlflow.db --port {port}   # then open "
                    f"http://127.0.0.1:{port}/#/experiments/1/runs?workflowType=machine_learning")


def test_a_tracking_server_is_opened_at_its_own_address():
    line = look_commands({"mlflow_tracking_uri": "http://mlflow.internal:8080"}, "bapo", "3")[0]
    assert line == "open http://mlflow.internal:8080/#/experiments/3/runs?workflowType=machine_learning"
