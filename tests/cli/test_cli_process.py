"""tests/support/cli_process.py, the forked `bapo-nemo` the CLI tests use, answers as `python -m bapo_nemo.cli` does:
the same exit status and output for the same command, in a process of its own, and exec whenever the
environment differs in something the pre-imported modules have already read."""

from __future__ import annotations

import os
import subprocess

import yaml

from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S


def _missing_task_file_run(cwd):
    cwd.mkdir()
    (cwd / "t.yaml").write_text(yaml.safe_dump({"task": {"train_file": "absent.jsonl"}, "runtime": {"progress": False}}))
    return cli_process.run("train", "t.yaml", "--output-dir", "out", cwd=cwd, env=cli_process.cli_env(),
                           timeout=HANG_GUARD_S)


def test_a_forked_call_answers_as_a_fresh_interpreter_does(tmp_path, monkeypatch):
    forked = _missing_task_file_run(tmp_path / "dir_one")
    monkeypatch.setenv("BAPO_TEST_EXEC_CLI", "1")
    executed = _missing_task_file_run(tmp_path / "dir_two")
    assert executed.returncode == forked.returncode == 2
    assert "absent.jsonl does not exist" in executed.stderr
    assert forked.stderr.replace("dir_one", "dir_two") == executed.stderr
    assert forked.stdout == executed.stdout
    assert forked.args == executed.args


def test_the_call_is_a_process_of_its_own_in_the_directory_it_was_given(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"task": {"train_file": "absent.jsonl"}, "runtime": {"progress": False}}))
    env = cli_process.cli_env({"MLFLOW_TRACKING_URI": "sqlite:///elsewhere.db"})
    process = cli_process.start("train", str(cfg), "--output-dir", "out", cwd=tmp_path, env=env)
    # MLflow reads MLFLOW_* when called: forked. Anything else would be a variable an earlier test left set
    assert isinstance(process, cli_process.CliProcess), cli_process.read_at_import_and_differing(env)
    assert process.wait(HANG_GUARD_S) == 2
    assert process.pid != os.getpid()
    _, stderr = process.communicate()
    assert f"starting fresh in {tmp_path / 'out'}" in stderr  # --output-dir relative to its directory


def test_an_environment_read_at_import_time_gets_a_fresh_interpreter(tmp_path):
    process = cli_process.start("check", "--help", cwd=tmp_path, env=cli_process.cli_env({"HF_HOME": str(tmp_path)}))
    try:
        assert isinstance(process, subprocess.Popen)
    finally:
        process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 0
