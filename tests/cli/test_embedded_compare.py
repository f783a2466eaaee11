"""A baseline beside a run, as a user runs it: `bapo-nemo train ... --compare-with RUN_DIR` tracks the new run
in the other run's MLflow store and experiment and reuses its warm-up when the warm-up's inputs are the same;
the run's ending prints the report command that draws both, and that command works. Real `bapo-nemo`
processes on the shared tiny run (copied first), real sqlite MLflow."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.support.tiny_run import bapo_nemo, with_, write_config


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_baseline_beside_a_run_is_one_command(trained, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(trained, runs / "bapo")  # the shared run, copied: this test adds runs to its store
    cfg = write_config(tmp_path)
    done = bapo_nemo("train", str(cfg), "loss_fn.bapo.enabled=false", "loss_fn.bapo.c_low_min=0.8",
                     "--output-dir", "runs/fixed", "--compare-with", "runs/bapo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # the warm-up is reused, not redone: the same weights give the same held-out score before RL
    assert ("reused the warm-up of runs/bapo (4 steps; the same model, tasks, warm-up settings, seed and input "
            "files)") in done.stderr
    assert "warm-up done" not in done.stderr
    assert _metrics(runs / "fixed")[0]["eval/avg_at_k"] == _metrics(runs / "bapo")[0]["eval/avg_at_k"]
    assert (runs / "fixed" / "warmup" / "info.json").read_text() == (runs / "bapo" / "warmup" / "info.json").read_text()
    # tracked beside it: one store, one experiment, both runs
    assert not (runs / "fixed" / "mlflow.db").exists()
    client = MlflowClient(f"sqlite:///{runs / 'bapo' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bapo-embedded")
    found = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(found) == ["fixed", "run"]  # the shared run was trained as --output-dir run
    assert found["fixed"].data.params["loss_fn.bapo.enabled"] == "False"
    # the ending names the report of both, and that command, run as printed, draws and compares them
    [report] = [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("bapo-nemo report")]
    assert report.endswith("--runs run fixed   # both runs side by side")
    assert "mlflow ui --backend-store-uri sqlite:///runs/bapo/mlflow.db" in done.stdout
    drawn = bapo_nemo(*shlex.split(report, comments=True)[1:], "--no-log", cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    lines = drawn.stdout.splitlines()
    assert lines[0].startswith("2 runs: run (") and ", fixed (" in lines[0]
    assert lines[1] == "held-out avg@k, 95% interval over prompts (8 prompts x 1 samples):"
    assert (runs / "bapo" / "report_bapo-embedded" / "training_dynamics.png").is_file()

    # resumed without --compare-with, the baseline goes on in the store it was tracked in
    more = bapo_nemo("train", str(cfg), "loss_fn.bapo.enabled=false", "loss_fn.bapo.c_low_min=0.8",
                     "--output-dir", "runs/fixed", "--resume", "--max-steps", "4", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-3000:]
    assert not (runs / "fixed" / "mlflow.db").exists()
    steps = sorted(m.step for m in client.get_metric_history(found["fixed"].info.run_id, "perf/step_time_s"))
    assert steps == [1, 2, 3, 4]

    # a warm-up of other inputs (another seed) is not reused, even beside the others
    other = bapo_nemo("train", str(write_config(tmp_path, with_(grpo={"max_num_steps": 1}), "one.yaml")),
                      "--seed", "1", "--output-dir", "runs/seed1", cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-3000:]
    assert "warm-up done (4 steps)" in other.stderr and "reused" not in other.stderr


def test_compare_with_what_is_not_a_run_is_one_line(trained, tmp_path):
    cfg = write_config(tmp_path)
    (tmp_path / "notes").mkdir()
    shutil.copytree(trained, tmp_path / "bapo")
    mistakes = {
        "nowhere": ("--compare-with nowhere: no such run directory: give the --output-dir of a `bapo-nemo train` "
                    "run, e.g. --compare-with runs/local_cpu"),
        "notes": "--compare-with notes: not the output directory of a `bapo-nemo train` run (no mlflow_run_id in it)",
        "out": "--compare-with out is this run's own --output-dir",
    }
    for target, says in mistakes.items():
        done = bapo_nemo("train", str(cfg), "--output-dir", "out", "--compare-with", target, cwd=tmp_path)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    clash = bapo_nemo("train", str(cfg), "logger.mlflow.tracking_uri=sqlite:///elsewhere.db", "--output-dir", "out",
                      "--compare-with", "bapo", cwd=tmp_path)
    assert clash.returncode == 2 and "but logger.mlflow.tracking_uri=sqlite:///elsewhere.db is set: drop one" \
        in clash.stderr, clash.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "elsewhere.db").exists()
