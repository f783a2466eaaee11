"""Configs and the commands that take them, run as a user runs them (subprocesses): a config given to the
wrong tool (`bapo-nemo train` with a NeMo-RL config, `bapo-nemo check` or the NeMo-RL driver with an
embedded one) says so in one line naming the right command, instead of one "unknown key" line per
section; and `bapo-nemo train X.yaml` writes to runs/X unless told otherwise."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bapo_nemo.config_kind import config_kind
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if argv[:2] == ("-m", "bapo_nemo.cli"):
        return cli_process.run(*argv[2:], cwd=cwd, env=env, timeout=HANG_GUARD_S)
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          check=False, env=env)


@pytest.mark.parametrize("name", ["bapo_7b.yaml", "bapo_32b_64k.yaml"])  # a full config; `defaults:` only
def test_train_given_a_nemo_rl_config_names_the_driver_and_check(name, tmp_path):
    config = f"configs/{name}"
    run = _run("-m", "bapo_nemo.cli", "train", str(REPO / config), "--output-dir", str(tmp_path / "out"),
               cwd=tmp_path)
    assert run.returncode == 2 and not (tmp_path / "out").exists()
    [line] = run.stderr.strip().splitlines()
    assert "is a NeMo-RL config" in line
    assert f"python -m bapo_nemo.train --config {REPO / config}" in line
    assert f"bapo-nemo check {REPO / config} --nodes N --gpus-per-node G" in line
    assert "unknown key" not in line


@pytest.mark.parametrize("argv", [
    ["-m", "bapo_nemo.cli", "check", "{config}", "--nodes", "1", "--gpus-per-node", "8"],
    ["-m", "bapo_nemo.train", "--config", "{config}"],
], ids=["check", "driver"])
@pytest.mark.parametrize("name", ["local_cpu.yaml", "own_model.yaml"])
def test_check_and_the_driver_given_an_embedded_config_name_bapo_nemo_train(argv, name, tmp_path):
    config = str(REPO / "configs" / name)
    run = _run(*(a.format(config=config) for a in argv), cwd=tmp_path)
    assert run.returncode != 0
    [line] = run.stderr.strip().splitlines() or run.stdout.strip().splitlines()
    assert "is an embedded config for one machine" in line and f"`bapo-nemo train {config}`" in line
    assert "not a NeMo-RL v0.7.0 config key" not in run.stdout + run.stderr


def test_a_config_that_does_not_say_its_kind_gets_the_tools_own_checks():
    """Only sections one kind alone has decide: a shared section (grpo:, policy:, ...) or a mix decides
    nothing, so each tool's own validation reports what is wrong."""
    assert config_kind({"grpo": {"max_num_steps": 3}, "policy": {}}) is None
    assert config_kind({"cluster": {}, "runtime": {}}) is None
    assert config_kind({"defaults": "bapo_7b.yaml"}) == "nemo_rl"
    assert config_kind({"grpo": {}, "train": {"updates_per_batch": 2}}) == "embedded"
    assert config_kind({"rollout": {"group_size": 4}}) == "embedded"  # the embedded config's old names
    assert config_kind(["not", "a", "mapping"]) is None


# configs/local_cpu.yaml shrunk to one RL step of a tiny model without warm-up (seconds on a CPU)
TINY_RUN = [
    "--max-steps", "1", "--no-progress", "warmup.steps=0", "grpo.num_prompts_per_step=2",
    "grpo.num_generations_per_prompt=2", "partial_rollouts.max_in_flight_groups=4", "task.eval_size=2",
    "eval.k=1",
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_heads=2", "model.num_kv_heads=1",
]


def test_train_without_output_dir_writes_to_runs_named_after_the_config(tmp_path):
    """`bapo-nemo train mine.yaml` lands in runs/mine, not in runs/local_cpu where another config's
    checkpoints would stop it ("already holds checkpoints ... pass --resume"); the summary it ends with
    points there. --seed sets grpo.seed."""
    (tmp_path / "mine.yaml").write_text((REPO / "configs" / "local_cpu.yaml").read_text())
    run = _run("-m", "bapo_nemo.cli", "train", "mine.yaml", *TINY_RUN, "--seed", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    checkpoint = tmp_path / "runs" / "mine" / "checkpoints" / "step_1"
    assert (checkpoint / "COMPLETE").is_file()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["mine"]
    assert yaml.safe_load((checkpoint / "config.yaml").read_text())["grpo"]["seed"] == 3
    lines = run.stdout.splitlines()
    assert lines[0] == "finished 1 RL steps in runs/mine", run.stdout
    assert "  (for scripts: runs/mine/summary.json, or --json)" in lines


def test_a_failed_run_without_output_dir_ends_its_log_in_runs_named_after_the_config(tmp_path):
    """The error a run ends with is the last line of the train.log of the directory it ran in."""
    (tmp_path / "down.yaml").write_text((REPO / "configs" / "local_cpu.yaml").read_text())
    run = _run("-m", "bapo_nemo.cli", "train", "down.yaml", *TINY_RUN, "logger.mlflow.tracking_uri=http://127.0.0.1:9",
               cwd=tmp_path)
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not create an MLflow run")
    log = (tmp_path / "runs" / "down" / "train.log").read_text().strip().splitlines()
    assert log[-1].split(" ", 1)[1] == last  # after the timestamp


def _examples(help_text: str, command: str) -> list[list[str]]:
    """The argv after `command` of each example line in a --help text (an env prefix and a trailing
    parenthetical comment dropped)."""
    lines = help_text.split("examples:", 1)[1].splitlines()
    found = []
    for line in lines:
        if command not in line:
            continue
        words = shlex.split(line.split("  (")[0])
        start = next(i for i in range(len(words)) if " ".join(words[i:]).startswith(command))
        found.append(words[start + len(command.split()):])
    return found


def test_the_driver_help_shows_its_hydra_overrides_and_how_it_differs_from_bapo_nemo_train(tmp_path):
    from bapo_nemo.nemo.driver import parse_args

    out = _run("-m", "bapo_nemo.train", "--help", cwd=tmp_path).stdout
    flat = " ".join(out.split())
    assert "[key=value ...]" in flat and "Hydra-style overrides" in flat and "++a.b=1 adds or sets" in flat
    assert "Not to be mixed up with `bapo-nemo train CONFIG" in flat and "configs/local_cpu.yaml" in flat
    examples = _examples(out, "python -m bapo_nemo.train")
    assert len(examples) == 3
    for argv in examples:
        args, overrides = parse_args(argv)
        assert args.config.startswith("configs/") and overrides == [a for a in argv if "=" in a]
    # what slurm/bapo_32b.sbatch passes (options and overrides intermixed)
    args, overrides = parse_args(["--config", "c.yaml", "checkpointing.checkpoint_dir=/o/checkpoints",
                                  "logger.log_dir=/o/logs", "--skip-checks", "cluster.num_nodes=2"])
    assert args.skip_checks and overrides == ["checkpointing.checkpoint_dir=/o/checkpoints",
                                              "logger.log_dir=/o/logs", "cluster.num_nodes=2"]


@pytest.mark.parametrize("command", ["check", "report", "export"])
def test_help_carries_examples_the_command_accepts(command, tmp_path):
    import argparse
    import importlib

    from bapo_nemo.cli import COMMANDS

    out = _run("-m", "bapo_nemo.cli", command, "--help", cwd=tmp_path).stdout
    examples = _examples(out, f"bapo-nemo {command}")
    assert len(examples) >= 3, out
    parser = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[command][0]).configure_parser(parser)
    for argv in examples:
        parser.parse_intermixed_args(argv)  # SystemExit on an example the command does not accept
