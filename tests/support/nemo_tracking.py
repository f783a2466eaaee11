"""NeMo-RL's tracking inputs for the tests of bapo_nemo.tracking.nemo_rl: the parts of a v0.7.0 GRPO
config that tracking reads, and, where NeMo-RL cannot be imported (the Python 3.11 suite), a stand-in for
its `Logger` that does what `MLflowLogger.__init__` does (resume the configured run id, else create a
run). The NeMo-RL tier runs the same code against the real classes (tests/nemo_rl/test_tracking.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from bapo_nemo.tracking.nemo_rl import prepare_logger_config


def v070_config(tmp_path: Path, **mlflow) -> dict:
    """The parts of examples/configs/grpo_math_1B.yaml (v0.7.0) that tracking reads."""
    return {
        "grpo": {"num_prompts_per_step": 32, "max_num_steps": 1000000},
        "loss_fn": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "bapo": {"enabled": True, "rho0": 0.4}},
        "policy": {"model_name": "Qwen/Qwen2.5-1.5B", "hf_config_overrides": {}},
        "env": {"math": {"num_workers": 8, "judge_api_key": "sk-abcdefghijklmnopqrstuvwxyz123456"}},
        "checkpointing": {"enabled": True, "checkpoint_dir": str(tmp_path / "results" / "grpo"), "save_period": 10},
        "logger": {
            "log_dir": str(tmp_path / "logs"), "num_val_samples_to_print": 0, "wandb_enabled": False,
            "tensorboard_enabled": False, "mlflow_enabled": False, "swanlab_enabled": False,
            "monitor_gpus": False, "wandb": {"project": "grpo-dev", "name": "grpo-dev-logger"},
            "tensorboard": {}, "mlflow": {"experiment_name": "grpo-dev", "run_name": "grpo-dev-logger", **mlflow},
            "gpu_monitoring": {"collection_interval": 10, "flush_interval": 10},
        },
    }


class StandInMLflowLogger:
    """Does what v0.7.0's MLflowLogger.__init__ does: resume the configured run id, else create a run."""

    def __init__(self, cfg: dict):
        if cfg.get("run_id"):
            self.run_id = cfg["run_id"]
            return
        client = MlflowClient(cfg["tracking_uri"])
        exp = client.get_experiment_by_name(cfg["experiment_name"])
        exp_id = exp.experiment_id if exp else client.create_experiment(cfg["experiment_name"],
                                                                         artifact_location=cfg["artifact_location"])
        self.run_id = client.create_run(exp_id, run_name=cfg["run_name"]).info.run_id


class StandInLogger:
    def __init__(self, cfg: dict):
        self.loggers = [StandInMLflowLogger(cfg["mlflow"])]


# ---- one job's attempts, as the tracking fault tests replay them ------------------------------------
@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    """An initialised sqlite store to copy (creating one runs MLflow's migrations, seconds)."""
    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def attempt_config(tmp_path: Path, template_db: Path, attempt: int, **mlflow) -> dict:
    """The config of attempt ``attempt`` of one job: same checkpoint dir, the driver's next ``exp_NNN``."""
    config = v070_config(tmp_path, **mlflow)
    config["logger"]["log_dir"] = str(tmp_path / "logs" / f"exp_{attempt:03d}")
    if "tracking_uri" not in mlflow:
        db = tmp_path / "mlflow.db"
        if not db.exists():
            shutil.copy(template_db, db)
        config["logger"]["mlflow"]["tracking_uri"] = f"sqlite:///{db}"
    return prepare_logger_config(config)


def checkpoint(config: dict, step: int, complete: bool = True) -> None:
    """What NeMo-RL's CheckpointManager does on disk: write tmp_step_N, rename it to step_N when complete."""
    root = Path(config["checkpointing"]["checkpoint_dir"])
    tmp = root / f"tmp_step_{step}"
    tmp.mkdir(parents=True)
    (tmp / "training_info.json").write_text(json.dumps({"step": step}))
    if complete:
        tmp.rename(root / f"step_{step}")


def complete(config: dict, step: int) -> None:
    root = Path(config["checkpointing"]["checkpoint_dir"])
    (root / f"tmp_step_{step}").rename(root / f"step_{step}")


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
