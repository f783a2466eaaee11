"""Races and late signals, run as users meet them (`bapo-nemo` processes on real files, a real sqlite MLflow
store, real signals) and made to happen by construction: each process under test waits at a barrier
(tests/support/barrier.py) at the point where the race is decided, and the test lets them go together."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.support import cli_process
from tests.support.barrier import Barrier
from tests.support.tiny_run import bapo_nemo, copy_run, with_, write_config


def _until(condition: Callable[[], bool], what: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"a process ended before {what}: " + ended[0].communicate()[1][-3000:]
        assert time.time() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def _start(barrier: Barrier, target: str, *args: str, cwd: Path) -> subprocess.Popen:
    return barrier.start(target, *args, cwd=cwd, env=cli_process.cli_env())


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
        return [(p.returncode, *output) for p, output in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _blocked_on_a_lock(pids: set[int]) -> set[int]:
    """The PIDs among `pids` waiting for a file lock (/proc/locks lists each waiter after '->')."""
    waiting = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and int(fields[fields.index("->") + 4]) in pids:
            waiting.add(int(fields[fields.index("->") + 4]))
    return waiting


# ---- 1. two exports into one new --out; a directory that appears at --out during an export --------------------
def test_two_exports_into_one_new_out_one_wins_and_the_other_refuses(trained, tmp_path):
    """Both exports pass every check made before the rename (they wait inside the export until both are
    there), then race to it: one writes the directory, the other refuses in one line, discarding its copy."""
    barrier, out = Barrier(tmp_path / "barrier"), tmp_path / "export"
    procs = [_start(barrier, "bapo_nemo.export.hf:save_round_trip_tokenizer", "export", str(trained), "--out",
                    str(out), cwd=tmp_path) for _ in range(2)]
    try:
        _until(lambda: barrier.arrived() == {p.pid for p in procs}, "both exports are inside the export", procs)
        barrier.release()
    finally:
        results = _finish(procs)
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [r[2][-2000:] for r in results]
    loser = next(err for code, _, err in results if code == 2)
    assert "appeared while this export ran" in loser and "discarded" in loser and "Traceback" not in loser
    assert (out / "BAPO_EXPORT").is_file() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["barrier", "export"]  # no partial copy left


def test_a_directory_that_appears_at_out_during_the_export_is_kept(trained, tmp_path):
    barrier, out = Barrier(tmp_path / "barrier"), tmp_path / "export"
    proc = _start(barrier, "bapo_nemo.export.hf:save_round_trip_tokenizer", "export", str(trained), "--out",
                  str(out), cwd=tmp_path)
    try:
        _until(lambda: barrier.arrived() == {proc.pid}, "the export is inside its work", [proc])
        out.mkdir()
        (out / "results.csv").write_text("precious\n")
        barrier.release()
    finally:
        [(code, _, err)] = _finish([proc])
    assert code == 2 and "appeared while this export ran" in err and "--force" in err, err[-2000:]
    assert [p.name for p in out.iterdir()] == ["results.csv"] and (out / "results.csv").read_text() == "precious\n"


# ---- 4. two runs creating one new sqlite MLflow store -------------------------------------------------------------
def test_two_runs_creating_one_sqlite_store_take_turns(tmp_path):
    """Two `bapo-nemo train` into one new store: each waits as MLflow is about to create the tables and run
    the schema migrations. Without a lock both get there and run them into one file together (the loser
    fails on `duplicate column name`); with it the second waits for the lock. They are let go when every
    process is at the barrier or waiting for a lock."""
    store = tmp_path / "shared" / "mlflow.db"
    cfg = write_config(tmp_path, with_(grpo={"max_num_steps": 1}, warmup={"steps": 1},
                                       logger={"mlflow": {"tracking_uri": f"sqlite:///{store}"}}))
    barrier = Barrier(tmp_path / "barrier")
    procs = [_start(barrier, "mlflow.store.db.utils:_initialize_tables", "train", str(cfg), "--output-dir",
                    f"run{i}", cwd=tmp_path) for i in range(2)]
    pids = {p.pid for p in procs}
    try:
        _until(lambda: barrier.arrived() and barrier.arrived() | _blocked_on_a_lock(pids) == pids,
               "every run is creating the store or waiting for its lock", procs)
        barrier.release()
    finally:
        results = _finish(procs)
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name("bapo-embedded").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    assert all("reward/mean" in r.data.metrics for r in runs)
    assert client.create_experiment("a-later-one")  # the store is whole for later runs


# ---- 9. a stop signal during the end-of-run work -----------------------------------------------------------------
def test_sigterm_during_the_end_of_run_work_finishes_and_closes_the_run(tmp_path):
    """SIGTERM while the finished run draws its training plot (held there by the barrier): the process used
    to die on it with the MLflow run left RUNNING; now the run is finished first and marked FINISHED."""
    cfg = write_config(tmp_path, with_(grpo={"max_num_steps": 1}, warmup={"steps": 1}))
    barrier = Barrier(tmp_path / "barrier")
    proc = _start(barrier, "bapo_nemo.embedded.run.trainer:_log_training_plot", "train", str(cfg), "--output-dir", "out",
                  "--json", cwd=tmp_path)
    try:
        _until(lambda: barrier.arrived() == {proc.pid}, "the run is in its end-of-run work", [proc])
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the handler runs at once; the wait only makes a process killed by it visible
        barrier.release()
    finally:
        [(code, out, err)] = _finish([proc])
    assert code == 0, err[-3000:]
    assert json.loads(out[out.index("{"):])["stopped_by_signal"] is None
    run = tmp_path / "out"
    from mlflow.tracking import MlflowClient

    run_id = (run / "mlflow_run_id").read_text().strip()
    assert MlflowClient(f"sqlite:///{run / 'mlflow.db'}").get_run(run_id).info.status == "FINISHED"
    assert (run / "hf_final" / "COMPLETE").read_text() == "step 1\n"
    assert "SIGTERM arrived after the last step: the run was finished first" in (run / "train.log").read_text()


# ---- 10. exporting a run while it trains and prunes its checkpoints ----------------------------------------------
def test_export_of_a_run_that_prunes_the_checkpoint_meanwhile(trained, tmp_path):
    """Two exports find step_3 (one given the run, one given step_3 itself) and wait; the run then trains on
    with checkpointing.keep_top_k=1, deleting step_3. The export of the run moves on to the newest checkpoint
    and says so; the export of step_3 says what happened and what to export instead."""
    run = copy_run(trained, tmp_path)
    barrier = Barrier(tmp_path / "barrier")
    exports = [_start(barrier, "bapo_nemo.export.hf:load_embedded", "export", str(source), "--out",
                      str(tmp_path / f"export_{i}"), cwd=tmp_path)
               for i, source in enumerate([run, run / "checkpoints" / "step_3"])]
    try:
        _until(lambda: barrier.arrived() == {p.pid for p in exports}, "both exports found step_3", exports)
        more = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run), "--resume", "--max-steps",
                         "5", "checkpointing.keep_top_k=1", cwd=tmp_path)
        assert more.returncode == 0, more.stderr[-3000:]
        assert not (run / "checkpoints" / "step_3").exists()  # the premise: pruned while the exports wait
        barrier.release()
    finally:
        (code_run, out_run, err_run), (code_step, _, err_step) = _finish(exports)
    assert code_run == 0, err_run[-3000:]
    assert "step_3 was deleted by the training run's checkpoint pruning" in out_run and "exporting step_5" in out_run
    assert json.loads((tmp_path / "export_0" / "bapo_training_info.json").read_text())["step"] == 5
    assert code_step == 2 and "Traceback" not in err_step, err_step[-3000:]
    assert "step_3 was deleted while it was read" in err_step and f"Export the run directory {run}" in err_step
    assert not (tmp_path / "export_1").exists()
    shutil.rmtree(run)
