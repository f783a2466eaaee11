"""NeMo-RL side of tracking: `prepare_logger_config` on plain dicts shaped like v0.7.0's GRPO config, and
`after_setup` against a real MLflow sqlite store, with a stand-in for NeMo-RL's `Logger` where NeMo-RL
cannot be imported (tests/support/nemo_tracking.py; the real classes: tests/nemo_rl/test_tracking.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from bapo_nemo.tracking.nemo_rl import RUN_FILE, after_setup, prepare_logger_config
from bapo_nemo.tracking.redact import REDACTED
from bapo_nemo.tracking.store import TrackingConfigError
from tests.support.nemo_tracking import StandInLogger, v070_config


def test_defaults_to_sqlite_under_log_dir_and_does_not_touch_input(tmp_path, monkeypatch):
    # NeMo-RL's MLflowLogger (in earlier in-process tests) leaves MLFLOW_TRACKING_URI set; the default
    # store chosen without it is under test here.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = v070_config(tmp_path)
    out = prepare_logger_config(config)
    assert config["logger"]["mlflow_enabled"] is False  # input untouched
    ml = out["logger"]["mlflow"]
    assert out["logger"]["mlflow_enabled"] is True
    assert ml["tracking_uri"] == f"sqlite:///{(tmp_path / 'logs').resolve() / 'mlflow.db'}"
    assert ml["experiment_name"] == "grpo-dev" and ml["run_name"] == "grpo-dev-logger"
    assert ml["artifact_location"] == (tmp_path / "logs" / "mlartifacts" / "grpo-dev").resolve().as_uri()
    assert "run_id" not in ml or ml["run_id"] is None
    assert out["loss_fn"] == config["loss_fn"]  # everything else as it was


def test_server_uri_routes_artifacts_through_the_server(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    out = prepare_logger_config(v070_config(tmp_path, tracking_uri="http://mlflow.internal:5000", run_name=None))
    ml = out["logger"]["mlflow"]
    assert ml["artifact_location"] == "mlflow-artifacts:/grpo-dev"
    assert ml["run_name"] == "grpo"  # the checkpoint dir's name
    import os

    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "5"


@pytest.mark.parametrize("uri", ["/shared/mlruns", "file:///shared/mlruns"])
def test_file_store_is_refused_naming_the_key(tmp_path, uri):
    with pytest.raises(TrackingConfigError, match=r"logger\.mlflow\.tracking_uri.*sqlite:///"):
        prepare_logger_config(v070_config(tmp_path, tracking_uri=uri))


def test_run_id_resumed_only_when_the_checkpoint_dir_holds_a_checkpoint(tmp_path):
    config = v070_config(tmp_path)
    ckpt = Path(config["checkpointing"]["checkpoint_dir"])
    ckpt.mkdir(parents=True)
    (ckpt / RUN_FILE).write_text(json.dumps({"run_id": "abc123", "tracking_uri": "sqlite:///elsewhere.db"}))
    # the run file alone (the job died before its first checkpoint) starts a new run: NeMo-RL restarts at step 0
    assert not prepare_logger_config(config)["logger"]["mlflow"].get("run_id")
    (ckpt / "step_10").mkdir()
    assert prepare_logger_config(config)["logger"]["mlflow"]["run_id"] == "abc123"
    # an explicit run id in the config wins
    config["logger"]["mlflow"]["run_id"] = "explicit"
    assert prepare_logger_config(config)["logger"]["mlflow"]["run_id"] == "explicit"
    (ckpt / RUN_FILE).write_text("{broken")
    config["logger"]["mlflow"]["run_id"] = None
    with pytest.raises(TrackingConfigError, match="mlflow_run.json is not valid JSON"):
        prepare_logger_config(config)


def test_missing_logger_section_is_a_clear_error():
    with pytest.raises(TrackingConfigError, match="no 'logger:' section"):
        prepare_logger_config({"grpo": {}})


def test_after_setup_tags_artifacts_run_file_and_journaled_metrics(tmp_path):
    config = prepare_logger_config(v070_config(tmp_path))
    nemo_logger = StandInLogger(config["logger"])
    tracker = after_setup(config, nemo_logger)
    backend = nemo_logger.loggers[0]
    run_id = backend.run_id
    saved = json.loads((Path(config["checkpointing"]["checkpoint_dir"]) / RUN_FILE).read_text())
    assert saved["run_id"] == run_id and saved["tracking_uri"] == config["logger"]["mlflow"]["tracking_uri"]

    # the logger's own call shape in grpo_train: nested dicts, numpy scalars, a prefix
    backend.log_metrics({"reward": np.float32(0.5), "bapo": {"c_high": 1.35}, "note": "text"}, 7, prefix="train")
    (Path(config["checkpointing"]["checkpoint_dir"]) / "step_7").mkdir()  # step 7 is sent once a checkpoint covers it
    assert tracker.flush() == 0
    client = MlflowClient(config["logger"]["mlflow"]["tracking_uri"])
    run = client.get_run(run_id)
    assert run.data.metrics == {"train/reward": 0.5, "train/bapo/c_high": 1.35}
    assert [m.step for m in client.get_metric_history(run_id, "train/reward")] == [7]
    assert run.data.tags["bapo.runtime"] == "nemo_rl" and run.data.tags["bapo.enabled"] == "true"
    assert "bapo.resumed_at" not in run.data.tags  # attaching to NeMo-RL's fresh run is not a resume
    assert run.data.params["bapo.rho0"] == "0.4"
    # v0.7.0 creates the experiment without a kind; MLflow 3 would file it as GenAI
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    config_file = Path(client.download_artifacts(run_id, "config/resolved_config.yaml", str(tmp_path / "dl")))
    logged = yaml.safe_load(config_file.read_text())
    assert logged["env"]["math"]["judge_api_key"] == REDACTED
    assert logged["env"]["math"]["num_workers"] == 8

    # a restarted job with a checkpoint resumes the same run id
    again = prepare_logger_config(v070_config(tmp_path))
    assert again["logger"]["mlflow"]["run_id"] == run_id


def test_after_setup_without_mlflow_backend_says_what_to_do(tmp_path):
    class NoBackends:
        def __init__(self):
            self.loggers = []

    config = prepare_logger_config(v070_config(tmp_path))
    with pytest.raises(TrackingConfigError, match="call prepare_logger_config"):
        after_setup(config, NoBackends())


MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
10.0.0.5:/export/home /shared nfs4 rw,relatime,vers=4.2 0 0
lustre@o2ib:/scratch /shared/scratch lustre rw,flock 0 0
tmpfs /shared/scratch/local\\040tmp tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    "path,expected",
    [
        ("/home/user/run", None),  # ext4 under /
        ("/shared/runs/mlflow", "nfs4"),
        ("/sharedx/run", None),  # a prefix of the name is not the mount point
        ("/shared/scratch/job/logs", "lustre"),  # the longest mount point wins
        ("/shared/scratch/local tmp/x", None),  # \040 in /proc/mounts is a space; tmpfs is local
    ],
)
def test_network_filesystem_from_proc_mounts(path, expected):
    from bapo_nemo.tracking.filesystems import network_filesystem

    assert network_filesystem(path, MOUNTS) == expected


def test_sqlite_store_on_a_network_filesystem_is_warned_about(tmp_path, monkeypatch, caplog):
    """The default sqlite store lands in logger.log_dir; on NFS/Lustre the driver says to use a server.
    The mount table is the boundary (this machine has no network filesystem): the run directory is
    declared a Lustre mount point in a stand-in /proc/mounts."""
    from bapo_nemo.tracking import filesystems

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # as in the defaults test above
    real = filesystems.filesystem_type
    mounts = f"/dev/sda1 / ext4 rw 0 0\nlustre@o2ib:/scratch {tmp_path / 'logs'} lustre rw 0 0\n"
    monkeypatch.setattr(filesystems, "filesystem_type", lambda path, _=None: real(path, mounts))
    with caplog.at_level("WARNING"):
        prepare_logger_config(v070_config(tmp_path))
    assert "is on lustre" in caplog.text and "MLFLOW_TRACKING_URI=http://" in caplog.text
    caplog.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    with caplog.at_level("WARNING"):
        prepare_logger_config(v070_config(tmp_path))
    assert "is on lustre" not in caplog.text  # a server: nothing to warn about


