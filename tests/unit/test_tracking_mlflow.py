"""MlflowTracker against a real `mlflow server` (sqlite backend, started on 127.0.0.1 by this module) and
against a plain sqlite store without a server. Everything is read back through MlflowClient."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_nemo.tracking.mlflow_tracker import EXPERIMENT_KIND_TAG, MlflowTracker
from bapo_nemo.tracking.redact import REDACTED, flatten, is_secret_key
from bapo_nemo.tracking.store import TrackingConfigError, TrackingUnavailableError
from bapo_nemo.tracking.tags import config_hash, default_tags
from tests.support.mlflow_server import MlflowServer
from tests.support.ports import free_port


@pytest.fixture(autouse=True)
def _a_live_server_may_answer_slowly(monkeypatch):
    """The tracker's 5 s HTTP timeout (HTTP_ENV_DEFAULTS) is for a dead server; these tests' outages are a
    stopped server, refused at once. A live server's answer on a loaded CI machine may take seconds, and a
    timeout there would turn into an outage the test did not make (records left journaled, a run left
    RUNNING), so the tests give it 120 s."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")


@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    """An initialised MLflow sqlite store; creating one runs MLflow's schema migrations (seconds), so each
    test copies this file instead of migrating its own."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, template_db):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    shutil.copy(template_db, srv.root / "server.db")  # skip the schema migrations at server start
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def sqlite_uri(template_db, tmp_path) -> str:
    shutil.copy(template_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path}/mlflow.db"


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


CONFIG = {
    "model": {"name": "tiny-qwen2", "hf_token": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"},
    "rollout": {"max_new_tokens": 64, "token_budget": 512},
    "tokenizer": {"pad_token": "<|endoftext|>"},
    "mlflow": {"tracking_uri": "https://alice:hunter2@mlflow.example.com"},
    "wandb_api_key": "abc123",
    "db": {"password": "pw-value-1", "credentials_file": "/secret/creds.json"},
    "bapo": {"rho0": 0.4, "c_high_max": 3.0},
}
SECRETS = ["hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "hunter2", "abc123", "pw-value-1", "/secret/creds.json",
           "sk-live-token-0123456789abcdefghij"]


def test_params_metrics_tags_artifacts_through_server(server, tmp_path):
    """Everything a training run logs is readable back from the server, with secrets redacted."""
    tracker = MlflowTracker(server.uri, "bapo-server", run_name="run-a", buffer_dir=tmp_path / "buf")
    tags = {**default_tags(CONFIG), "user_note": "first run", "OPENAI_KEY": "sk-live-token-0123456789abcdefghij"}
    run_id = tracker.start(CONFIG, tags)
    for step in range(3):
        tracker.log_metrics({"reward/mean": 0.1 * step, "bapo/c_high": 1.2 + 0.05 * step}, step=step)
    tracker.log_table([{"step": 2, "prompt": "1+1=", "response": "2"},
                       {"step": 2, "prompt": "2+2=", "response": "4", "reward": 1.0}], "generations/step_2.json")
    (tmp_path / "config.yaml").write_text("bapo:\n  rho0: 0.4\n")
    tracker.log_artifact(tmp_path / "config.yaml", artifact_path="config")
    tracker.finish()

    client = MlflowClient(server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run-a"
    params = run.data.params
    assert params["model.name"] == "tiny-qwen2"
    assert params["rollout.max_new_tokens"] == "64" and params["rollout.token_budget"] == "512"
    assert params["tokenizer.pad_token"] == "<|endoftext|>"  # a special-token name is not a secret
    assert params["bapo.rho0"] == "0.4"
    assert params["model.hf_token"] == REDACTED and params["wandb_api_key"] == REDACTED
    assert params["db.password"] == REDACTED and params["db.credentials_file"] == REDACTED
    assert params["mlflow.tracking_uri"] == f"https://alice:{REDACTED}@mlflow.example.com"
    assert run.data.tags["OPENAI_KEY"] == REDACTED
    everything = " ".join(list(params.values()) + list(run.data.tags.values()))
    for secret in SECRETS:
        assert secret not in everything, secret
    assert run.data.tags["config_hash"] == config_hash(CONFIG)
    assert run.data.tags["host"] == socket.gethostname() and run.data.tags["user_note"] == "first run"
    # 0.1*step for steps 0..2 -> 0.0, 0.1, 0.2
    assert _history(client, run_id, "reward/mean") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert _history(client, run_id, "bapo/c_high") == [(0, 1.2), (1, 1.25), (2, pytest.approx(1.3))]
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config", "generations"}
    table = Path(client.download_artifacts(run_id, "generations/step_2.json", str(tmp_path / "dl")))
    payload = json.loads(table.read_text())
    assert payload["columns"] == ["step", "prompt", "response", "reward"]
    assert payload["data"][1] == [2, "2+2=", "4", 1.0] and payload["data"][0][3] is None
    assert client.download_artifacts(run_id, "config/config.yaml", str(tmp_path / "dl2"))
    resolved = Path(client.download_artifacts(run_id, "config/resolved_config.yaml", str(tmp_path / "dl3")))
    text = resolved.read_text()
    assert "tiny-qwen2" in text and "max_new_tokens: 64" in text
    for secret in SECRETS:
        assert secret not in text, secret
    # an acknowledged journal is compacted: nothing left to replay
    assert (tmp_path / "buf" / f"{run_id}.jsonl").read_text() == ""


def test_outage_buffers_and_replays_every_metric_exactly_once(server, tmp_path):
    """Stop the real server mid-run, keep logging (training goes on), restart it on the same port and store,
    reopen the run from a new tracker (as a restarted trainer does) and flush: steps 0..11 each exactly once."""
    buf = tmp_path / "buf"
    tracker = MlflowTracker(server.uri, "bapo-outage", buffer_dir=buf, retry_interval_s=3600)
    run_id = tracker.start({"lr": 1e-5}, {"phase": "before"})
    for step in range(4):
        tracker.log_metrics({"loss": float(step), "grad_norm": 10.0 + step}, step=step)
    server.stop()
    for step in range(4, 8):  # first call fails fast (connection refused) and backs off; the rest only journal
        tracker.log_metrics({"loss": float(step), "grad_norm": 10.0 + step}, step=step)
    (tmp_path / "plot.txt").write_text("curve")
    tracker.log_artifact(tmp_path / "plot.txt")
    (tmp_path / "plot.txt").unlink()  # the staged copy must survive the caller deleting its file
    tracker.finish("KILLED")  # e.g. the trainer's SIGTERM handler, while the server is still down
    assert tracker.flush() == 6  # 4 metric records + 1 artifact + the status, still down
    del tracker  # the trainer process dies during the outage

    server.start()
    resumed = MlflowTracker(server.uri, "bapo-outage", run_id=run_id, buffer_dir=buf)
    assert resumed.start({"lr": 1e-5, "new_setting": 3}, {"phase": "after"}) == run_id
    # the undelivered KILLED status of the dead process is superseded by the resumed run
    assert MlflowClient(server.uri).get_run(run_id).info.status == "RUNNING"
    for step in range(8, 12):
        resumed.log_metrics({"loss": float(step), "grad_norm": 10.0 + step}, step=step)
    assert resumed.flush() == 0
    resumed.finish()

    client = MlflowClient(server.uri)
    assert _history(client, run_id, "loss") == [(s, float(s)) for s in range(12)]
    assert _history(client, run_id, "grad_norm") == [(s, 10.0 + s) for s in range(12)]
    run = client.get_run(run_id)
    assert run.data.params == {"lr": "1e-05", "new_setting": "3"}
    assert run.data.tags["phase"] == "after" and "bapo.resumed_at" in run.data.tags
    assert run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run_id)] == ["config", "plot.txt"]  # config: start() logs it


def test_new_run_with_server_down_fails_fast_with_clear_error(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    tracker = MlflowTracker(dead, "nowhere", buffer_dir=tmp_path)
    with pytest.raises(TrackingUnavailableError, match="Start the tracking server"):
        tracker.start({}, {})


def test_replay_after_lost_acknowledgement_does_not_duplicate(tmp_path, sqlite_uri):
    """A record the store accepted but whose acknowledgement was lost (cursor not advanced) is sent again on
    replay; the journaled timestamp makes it identical, so the SQL store keeps one row."""
    uri = sqlite_uri
    buf = tmp_path / "buf"
    tracker = MlflowTracker(uri, "dedup", buffer_dir=buf)
    run_id = tracker.start({"a": 1}, {})
    journal = buf / f"{run_id}.jsonl"
    tracker.journal.compact = lambda: None  # keep the journal to simulate the crash window before compaction
    for step in range(3):
        tracker.log_metrics({"reward/mean": step / 2}, step=step)
    (buf / f"{run_id}.cursor").write_text("0")  # lost acknowledgements: everything replays
    assert len(journal.read_text().splitlines()) == 3  # the params record was compacted at start()

    replay = MlflowTracker(uri, "dedup", run_id=run_id, buffer_dir=buf)
    assert replay.flush() == 0
    client = MlflowClient(uri)
    assert _history(client, run_id, "reward/mean") == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert client.get_run(run_id).data.params == {"a": "1"}


def test_torn_last_journal_line_is_ignored(tmp_path, sqlite_uri):
    uri = sqlite_uri
    buf = tmp_path / "buf"
    run_id = MlflowTracker(uri, "torn", buffer_dir=buf).start({}, {})
    (buf / f"{run_id}.jsonl").write_text(
        '{"seq": 100, "kind": "metrics", "step": 5, "timestamp": 1000, "metrics": {"x": 2.0}}\n{"seq": 101, "ki'
    )
    tracker = MlflowTracker(uri, "torn", run_id=run_id, buffer_dir=buf)
    assert tracker.flush() == 0
    assert _history(MlflowClient(uri), run_id, "x") == [(5, 2.0)]
    tracker.log_metrics({"x": 3.0}, step=6)  # sequence continues after the torn record
    assert _history(MlflowClient(uri), run_id, "x") == [(5, 2.0), (6, 3.0)]


def test_rejected_record_is_isolated_and_kept(tmp_path, sqlite_uri):
    """A journal left by a dead process holds a record MLflow refuses for good (an invalid metric name)
    between valid ones: the valid ones are logged, the bad one moves to <run_id>.rejected.jsonl."""
    buf = tmp_path / "buf"
    run_id = MlflowTracker(sqlite_uri, "reject", buffer_dir=buf).start({}, {})
    lines = [{"seq": 100 + i, "kind": "metrics", "step": i, "timestamp": 1000 + i, "metrics": {key: float(i)}}
             for i, key in enumerate(["loss", "bad!name", "loss"])]
    (buf / f"{run_id}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tracker = MlflowTracker(sqlite_uri, "reject", run_id=run_id, buffer_dir=buf)
    assert tracker.flush() == 0
    assert _history(MlflowClient(sqlite_uri), run_id, "loss") == [(0, 0.0), (2, 2.0)]
    (rejected,) = [json.loads(x) for x in (buf / f"{run_id}.rejected.jsonl").read_text().splitlines()]
    assert rejected["seq"] == 101 and rejected["metrics"] == {"bad!name": 1.0} and "bad!name" in rejected["error"]


def test_sqlite_artifacts_land_next_to_the_database(tmp_path, monkeypatch, template_db):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "db").mkdir()
    shutil.copy(template_db, tmp_path / "db" / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/db/mlflow.db"
    tracker = MlflowTracker(uri, "art", buffer_dir=tmp_path / "buf")
    run_id = tracker.start({}, {})
    (tmp_path / "f.txt").write_text("x")
    tracker.log_artifact(tmp_path / "f.txt")
    tracker.finish("FAILED")
    assert not (tmp_path / "mlruns").exists()
    assert list((tmp_path / "db" / "mlartifacts").rglob("f.txt"))
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"


def test_resume_unknown_run_names_it(tmp_path, sqlite_uri):
    uri = sqlite_uri
    MlflowTracker(uri, "x", buffer_dir=tmp_path).start({}, {})
    with pytest.raises(TrackingConfigError, match="0123456789abcdef0123456789abcdef.*does not exist"):
        MlflowTracker(uri, "x", run_id="0123456789abcdef0123456789abcdef", buffer_dir=tmp_path).start({}, {})


def test_resume_with_changed_param_keeps_old_value_and_tags_the_change(tmp_path, sqlite_uri):
    uri = sqlite_uri
    run_id = MlflowTracker(uri, "x", buffer_dir=tmp_path).start({"steps": 10, "lr": 0.1}, {})
    MlflowTracker(uri, "x", run_id=run_id, buffer_dir=tmp_path).start({"steps": 20, "lr": 0.1}, {})
    run = MlflowClient(uri).get_run(run_id)
    assert run.data.params == {"steps": "10", "lr": "0.1"}
    assert run.data.tags["bapo.params_changed_on_resume"] == "steps"


def test_experiments_are_marked_as_training_ones_and_a_chosen_kind_stays(tmp_path, sqlite_uri):
    """MLflow 3's experiment kind: a new experiment is created as a training one; one without a kind (as
    NeMo-RL's logger creates it) gets it when a run is resumed in it; a kind someone chose is kept. The
    tracker knows the experiment id either way (the run's UI link needs it)."""
    client = MlflowClient(sqlite_uri)
    fresh = MlflowTracker(sqlite_uri, "fresh", buffer_dir=tmp_path)
    fresh.start({}, {})
    experiment = client.get_experiment_by_name("fresh")
    assert experiment.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert fresh.experiment_id == experiment.experiment_id
    bare = client.create_experiment("bare")
    resumed = MlflowTracker(sqlite_uri, "bare", run_id=client.create_run(bare).info.run_id, buffer_dir=tmp_path)
    resumed.start({}, {})
    assert client.get_experiment(bare).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    assert resumed.experiment_id == bare
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    MlflowTracker(sqlite_uri, "chosen", buffer_dir=tmp_path).start({}, {})
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


@pytest.mark.parametrize("uri", ["/tmp/mlruns", "file:///tmp/mlruns", "./mlruns", "sqlite://relative.db", ""])
def test_plain_file_store_and_malformed_uris_are_refused(uri, tmp_path):
    with pytest.raises(TrackingConfigError, match="sqlite:///"):
        MlflowTracker(uri, "x", buffer_dir=tmp_path)


def test_non_numeric_metric_names_the_key(tmp_path, sqlite_uri):
    tracker = MlflowTracker(sqlite_uri, "x", buffer_dir=tmp_path)
    tracker.start({}, {})
    with pytest.raises(TypeError, match="'reward/mean' at step 3"):
        tracker.log_metrics({"reward/mean": "high"}, step=3)


@pytest.mark.parametrize(
    "key, secret",
    [
        ("hf_token", True), ("model.HF_TOKEN", True), ("wandb.api_key", True), ("apiKey", True),
        ("db_password", True), ("aws_secret_access_key", True), ("credentials_path", True),
        ("auth", True), ("client_secret_id", True),
        ("max_new_tokens", False), ("token_budget", False), ("pad_token", False), ("eos_token", False),
        ("pad_token_id", False), ("key_frames", False), ("num_keys_seen", False), ("monkey_patch", False),
    ],
)
def test_secret_key_rule(key, secret):
    assert is_secret_key(key) is secret


def test_flatten_nested_lists_and_long_values():
    flat = flatten({"a": {"b": [1, 2], "c": {"d": None}}, "long": "x" * 7000, "empty": {}})
    assert flat["a.b"] == "[1, 2]" and flat["a.c.d"] == "None" and flat["empty"] == "{}"
    assert len(flat["long"]) == 6000 and flat["long"].endswith("...[truncated]")


def test_default_tags_read_environment(monkeypatch):
    monkeypatch.setenv("BAPO_CONTAINER_IMAGE", "nvcr.io/nvidia/nemo-rl:v0.7.0")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("BAPO_GIT_COMMIT", "0" * 40)
    tags = default_tags({"b": 1, "a": 2})
    assert tags["container_image"] == "nvcr.io/nvidia/nemo-rl:v0.7.0"
    assert tags["slurm.job_id"] == "4242" and tags["git.commit"] == "0" * 40
    assert tags["config_hash"] == config_hash({"a": 2, "b": 1})  # key order does not matter
    assert tags["host"] == socket.gethostname()
