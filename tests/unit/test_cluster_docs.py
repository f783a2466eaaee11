"""docs/cluster.md says what the launch scripts and configs do: the figures and paths it gives are read back
from slurm/*.sbatch, configs/*.yaml and the MLflow set-up the driver runs (its dataset table, against
NeMo-RL's own classes: tests/nemo_rl/test_cluster_docs.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_nemo.plan.rules.config_io import load_nemo_config
from bapo_nemo.plan.rules.hub_assets import HubAsset, hub_assets
from bapo_nemo.plan.rules.signal_lead import signal_line
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "cluster.md").read_text()
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
NEMO_CONFIGS = ["bapo_7b", "bapo_32b", "bapo_32b_64k"]


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_signal_lead_the_doc_gives_is_the_scripts():
    """Every place the doc states the shipped lead: the requeue paragraph (minutes, seconds and the #SBATCH
    line), the sizing table's "shipped lead" column (per script) and the sentence under it."""
    leads = {path.name: signal_line(path).seconds for path in SCRIPTS}
    assert set(leads) == {"bapo_32b.sbatch", "bapo_7b.sbatch"}
    minutes, seconds, line = re.search(
        r"asks for `SIGUSR1` (\d+) minutes \(([\d,]+) s\) before its time limit\s+\(`#SBATCH --signal=B:USR1@(\d+)` "
        r"in both scripts", DOC).groups()
    assert {int(minutes) * 60, _number(seconds), int(line)} == set(leads.values())
    table = re.findall(r"\| ([\d,]+) s \(`(bapo_\w+\.sbatch)`\) \|", DOC)
    assert table and all(_number(s) == leads[name] for s, name in table)
    shipped = re.search(r"The shipped scripts signal ([\d,]+) s before the limit", DOC).group(1)
    assert {_number(shipped)} == set(leads.values())


def _output_dir(config: str) -> str:
    """OUTPUT_DIR as slurm/bapo_32b.sbatch sets it by default, evaluated by bash from the script's own line."""
    line = next(ln for ln in (REPO / "slurm" / "bapo_32b.sbatch").read_text().splitlines()
                if ln.startswith("OUTPUT_DIR="))
    done = subprocess.run(["bash", "-c", f'BAPO_REPO=/repo CONFIG={config}; {line}; echo "$OUTPUT_DIR"'],
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.parametrize("name", NEMO_CONFIGS)
def test_a_config_and_its_job_write_one_run_directory(name):
    """The job runs in the checkout (--container-workdir) with checkpoint_dir and log_dir under OUTPUT_DIR;
    the config's own paths, relative to the checkout, are the same directories."""
    config = load_nemo_config(REPO / "configs" / f"{name}.yaml")
    output_dir = _output_dir(f"configs/{name}.yaml")
    assert output_dir == f"/repo/results/{name}"
    script = (REPO / "slurm" / "bapo_32b.sbatch").read_text()
    assert '"checkpointing.checkpoint_dir=$OUTPUT_DIR/checkpoints"' in script
    assert '"logger.log_dir=$OUTPUT_DIR/logs"' in script and '--container-workdir="$BAPO_REPO"' in script
    assert f"/repo/{config['checkpointing']['checkpoint_dir']}" == f"{output_dir}/checkpoints"
    assert f"/repo/{config['logger']['log_dir']}" == f"{output_dir}/logs"


def test_the_cluster_mlflow_store_is_where_the_doc_says(tmp_path, monkeypatch):
    """The driver's MLflow set-up on the shipped config with the job's overrides (OUTPUT_DIR = tmp_path)."""
    from bapo_nemo.tracking.nemo_rl import RUN_FILE, prepare_logger_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load_nemo_config(REPO / "configs" / "bapo_32b.yaml", [
        f"checkpointing.checkpoint_dir={tmp_path}/checkpoints", f"logger.log_dir={tmp_path}/logs"])
    mlflow = prepare_logger_config(config)["logger"]["mlflow"]
    assert mlflow["tracking_uri"] == f"sqlite:///{tmp_path}/logs/mlflow.db"
    assert mlflow["artifact_location"] == (tmp_path / "logs" / "mlartifacts" / "bapo").as_uri()
    row = next(ln for ln in DOC.splitlines() if ln.startswith("| NeMo-RL (container) |"))
    expected = ["`sqlite:///$OUTPUT_DIR/logs/mlflow.db`", "`$OUTPUT_DIR/logs/mlartifacts/<experiment>/`",
                f"(`{mlflow['experiment_name']}`)", f"(`{mlflow['run_name']}`", f"`$OUTPUT_DIR/checkpoints/{RUN_FILE}`"]
    for cell in expected:
        assert cell in row, cell


def test_hub_assets_of_the_32b_config_and_the_prefetch_command_the_doc_gives():
    assets, unknown = hub_assets(load_nemo_config(REPO / "configs" / "bapo_32b.yaml"))
    assert unknown == []
    assert assets == [
        HubAsset("model", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"),
        HubAsset("dataset", "BytedTsinghua-SIA/DAPO-Math-17k", None, "train"),
        HubAsset("dataset", "HuggingFaceH4/aime_2024", None, "train"),
        HubAsset("dataset", "opencompass/AIME2025", "AIME2025-I", "test"),
        HubAsset("dataset", "opencompass/AIME2025", "AIME2025-II", "test"),
    ]
    command = "python -m bapo_nemo.plan.rules.hub_assets configs/bapo_32b.yaml --dry-run"
    assert command in DOC
    done = subprocess.run([sys.executable, *command.split()[1:]], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, check=False, env={"PATH": "/usr/bin:/bin", "HF_HOME": "/shared/hf_cache"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["would fetch into /shared/hf_cache:", *(f"  {a}" for a in assets)]
    for asset in assets:  # the doc names every repository the job needs
        assert f"`{asset.repo_id}`" in DOC
