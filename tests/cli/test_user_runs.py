"""What a user can do to a run that must lose nothing and leak nothing, run as the user runs it: `bapo-nemo`
in a subprocess on real files, a real MLflow server or sqlite store, a real terminal that closes, a real
filesystem that fills up."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.ports import free_port
from tests.support.tiny_run import bapo_nemo, copy_run, tree_digest, with_, write_config


def _status(run: Path) -> str:
    from mlflow.tracking import MlflowClient

    run_id = (run / "mlflow_run_id").read_text().strip()
    return MlflowClient(f"sqlite:///{run / 'mlflow.db'}").get_run(run_id).info.status


# ---- 2. an output directory inside another run ----------------------------------------------------------------
def test_output_dir_inside_another_run_is_refused(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    before = tree_digest(run)
    done = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run / "checkpoints" / "step_1"),
                     cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"is inside the output directory of another run, {run}" in done.stderr
    assert tree_digest(run) == before


# ---- 3. a checkpoint whose trainer state belongs to another step -----------------------------------------------
def test_resume_skips_a_checkpoint_whose_state_is_of_another_step_and_keeps_the_log(trained, tmp_path):
    """step_3's trainer_state.pt swapped for step_1's (intact, but not step_3's): resume must not trust it,
    nor cut metrics.jsonl to step 1 on its word; it resumes from step_2 and redoes step 3."""
    run = copy_run(trained, tmp_path)
    shutil.copy(run / "checkpoints" / "step_1" / "trainer_state.pt", run / "checkpoints" / "step_3" / "trainer_state.pt")
    done = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run), "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipping checkpoint step_3: trainer_state.pt belongs to step 1" in done.stderr, done.stderr[-3000:]
    assert "resuming from step 2" in done.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    assert [json.loads(line)["step"] for line in (run / "trained_groups.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert _status(run) == "FINISHED"


def test_a_damaged_warm_up_cache_is_redone_not_loaded(trained, tmp_path):
    """A run directory holding a cached warm-up whose weights were truncated (a full disk, a partial copy):
    the new run says so and warms up again instead of failing on the load."""
    (tmp_path / "run").mkdir()
    shutil.copytree(trained / "warmup", tmp_path / "run" / "warmup")
    weights = tmp_path / "run" / "warmup" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    done = bapo_nemo("train", str(write_config(tmp_path, with_(grpo={"max_num_steps": 1}))), "--output-dir", "run",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warmup is damaged (model/model.safetensors is truncated" in done.stderr and "redoing the warm-up" in done.stderr
    assert "warm-up done" in done.stderr and _status(tmp_path / "run") == "FINISHED"


# ---- 5. secrets in everything a run writes or uploads ------------------------------------------------------------
PASSWORD = "Tr0ub4dor-and-3"
RUN_NAME_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWx12"
REGISTRY_PASSWORD = "Regi5try-Pa55"
SLURM_TOKEN = "ghp_" + "ZyXwVuTsRqPoNmLkJiHgFe98765"
SECRETS = (PASSWORD, RUN_NAME_TOKEN, REGISTRY_PASSWORD, SLURM_TOKEN)


def _files_holding_secrets(root: Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path}: {secret}" for secret in SECRETS if secret.encode() in data]
    return found


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` (sqlite backend, artifacts served from a local directory) on a free port."""
    root = tmp_path / "server"
    root.mkdir()
    port = free_port()
    with open(root / "server.log", "w") as server_log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
             str(root / "artifacts")],
            cwd=root, stdout=subprocess.DEVNULL, stderr=server_log, env=cli_process.cli_env(), start_new_session=True)
        try:
            deadline = time.time() + HANG_GUARD_S  # a hang guard: under the whole suite a start took over 180 s
            while True:  # serving: its first answer also creates its store
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as answer:
                        if answer.status == 200:
                            break
                except OSError:
                    pass
                assert proc.poll() is None and time.time() < deadline, (root / "server.log").read_text()[-2000:]
                time.sleep(0.3)
            yield port, root
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # its workers can take long to drain; nothing of theirs is tested
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.mark.slow
def test_no_secret_in_any_file_the_run_writes_or_the_mlflow_store_holds(mlflow_server, tmp_path):
    """A password in the tracking URI, a token as the run name, a registry password in the container image and
    a token as the Slurm job name: none may appear in any file of the run, of its export, or of the MLflow
    server's store (database and artifacts)."""
    port, server_root = mlflow_server
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{port}"
    cfg = write_config(tmp_path, with_(grpo={"max_num_steps": 2}, warmup={"steps": 1},
                                       logger={"mlflow": {"tracking_uri": uri, "run_name": RUN_NAME_TOKEN}}))
    env = {"BAPO_CONTAINER_IMAGE": f"https://bob:{REGISTRY_PASSWORD}@registry.example/bapo:1",
           "SLURM_JOB_NAME": SLURM_TOKEN,
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "120"}  # a server on a loaded machine may take over the default 5 s
    done = bapo_nemo("train", str(cfg), "--output-dir", "run", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = bapo_nemo("export", "run", "--out", "export", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    for text in (done.stdout, done.stderr, exported.stdout, exported.stderr):
        assert not [s for s in SECRETS if s in text], text[-3000:]
    assert _files_holding_secrets(tmp_path / "run") == []
    assert _files_holding_secrets(tmp_path / "export") == []
    assert _files_holding_secrets(server_root / "artifacts") == []
    for db in server_root.glob("mlflow.db*"):  # the database and any journal beside it
        assert not [s for s in SECRETS if s.encode() in db.read_bytes()], db
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"http://127.0.0.1:{port}").get_run((tmp_path / "run" / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == "***redacted***"
    assert "summary.json" in [a.path for a in MlflowClient(f"http://127.0.0.1:{port}").list_artifacts(run.info.run_id)]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mlflow_tracking_uri"] == f"http://alice:***redacted***@127.0.0.1:{port}"


# ---- 6. resume a finished run to more steps ----------------------------------------------------------------------
def test_resume_to_more_steps_replaces_hf_final_with_the_last_step(trained, tmp_path):
    from safetensors.torch import load_file

    run = copy_run(trained, tmp_path)
    assert (run / "hf_final" / "COMPLETE").read_text() == "step 3\n"
    done = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run), "--resume", "--max-steps", "5",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"finished at step 5: {run / 'hf_final'}" in done.stderr
    assert (run / "hf_final" / "COMPLETE").read_text() == "step 5\n"
    final = load_file(run / "hf_final" / "model.safetensors")
    step_5 = load_file(run / "checkpoints" / "step_5" / "model" / "model.safetensors")
    assert final.keys() == step_5.keys() and all((final[k] == step_5[k]).all() for k in final)


# ---- 9. the terminal closes ---------------------------------------------------------------------------------------
def test_closing_the_terminal_stops_with_a_checkpoint_and_marks_the_run_killed(tmp_path):
    """`bapo-nemo train` in a real terminal (a pty, progress bar on), which is then closed: the kernel sends
    SIGHUP and every later write to the terminal fails. The run stops after the step, checkpoints, says so
    in train.log and marks the MLflow run KILLED; exit 129 (128 + SIGHUP)."""
    cfg = write_config(tmp_path, with_(runtime={"progress": True}, grpo={"max_num_steps": 500},
                                       checkpointing={"save_period": 100}, warmup={"steps": 1}))
    metrics = tmp_path / "out" / "metrics.jsonl"
    pid, terminal = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        os.chdir(tmp_path)
        os.execve(sys.executable, [sys.executable, "-m", "bapo_nemo.cli", "train", str(cfg), "--output-dir", "out"],
                  cli_process.cli_env())
    try:
        deadline = time.time() + HANG_GUARD_S
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert time.time() < deadline, "the run did not reach step 1"
            if select.select([terminal], [], [], 0.2)[0]:
                try:
                    os.read(terminal, 65536)  # what the user's terminal shows
                except OSError:
                    break
        os.close(terminal)  # the terminal window closes
        deadline = time.time() + HANG_GUARD_S
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            assert time.time() < deadline, "the run did not stop after SIGHUP"
            time.sleep(0.2)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert os.waitstatus_to_exitcode(ended[1]) == 129
    log = (tmp_path / "out" / "train.log").read_text()
    assert "stopped by SIGHUP at step" in log, log[-2000:]
    step = int(log.split("stopped by SIGHUP at step ")[1].split()[0])
    assert (tmp_path / "out" / "checkpoints" / f"step_{step}" / "COMPLETE").is_file()
    assert _status(tmp_path / "out") == "KILLED"


# ---- 10. a full disk; a store deleted under a run -----------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """`mount(size_bytes)`: a real filesystem of that size (tmpfs; mounting needs root)."""
    mounts = []

    def mount(size: int) -> Path:
        where = tmp_path / "small_disk"
        where.mkdir()
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True, check=False)
        if made.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip()}): needs root")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_while_saving_the_trainer_state_says_so(small_disk, tmp_path):
    """A disk with room for the fp32 weights W three times (the warm-up cache, step_0's and step_1's models)
    and W/2 more: step_0's trainer state is small (AdamW has no moments before its first update), step_1's
    holds the moments (2W) and does not fit, so the save fails in torch.save of the trainer state, which used
    to say "unexpected pos N vs M". Now: one line saying the disk is full, the run marked FAILED, step_0
    intact, no step_1 or partial directory left."""
    from bapo_nemo.embedded.config.run_config import load_config
    from bapo_nemo.embedded.model.policy import build_model
    from bapo_nemo.embedded.model.tokenizer import load_tokenizer

    data = with_(model={"hidden_size": 64, "intermediate_size": 256, "num_layers": 2, "num_heads": 2,
                        "num_kv_heads": 1},
                 warmup={"steps": 1}, logger={"mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/m.db"}})
    cfg = write_config(tmp_path, data)
    weights = 4 * sum(p.numel() for p in build_model(load_config(cfg).model, load_tokenizer(), 0).parameters())
    disk = small_disk(3 * weights + weights // 2)
    done = bapo_nemo("train", str(cfg), "--output-dir", str(disk / "run"), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "no space left on device while writing checkpoint" in done.stderr, done.stderr[-3000:]
    assert "unexpected pos" not in done.stderr
    checkpoints = disk / "run" / "checkpoints"
    assert (checkpoints / "step_0" / "COMPLETE").is_file() and not (checkpoints / "step_1").exists()
    assert not list(checkpoints.glob(".tmp_step_*"))
    from mlflow.tracking import MlflowClient

    run_id = (disk / "run" / "mlflow_run_id").read_text().strip()
    assert MlflowClient(f"sqlite:///{tmp_path}/m.db").get_run(run_id).info.status == "FAILED"


def test_resume_with_the_mlflow_store_deleted_names_the_file_and_creates_nothing(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    (run / "mlflow.db").unlink()
    done = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run), "--resume", "--max-steps", "4",
                     cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"the MLflow store {run / 'mlflow.db'} does not exist" in done.stderr
    assert "restore the file from a copy, set logger.mlflow.tracking_uri" in done.stderr
    assert "drop run_id" not in done.stderr and not (run / "mlflow.db").exists()
    assert not (run / "checkpoints" / "step_4").exists()
