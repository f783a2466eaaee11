"""Config blocks the NeMo-RL CPU tests share: the tiny arithmetic data, its math environment and where the
run logs (a private MLflow store)."""

from __future__ import annotations

from pathlib import Path


def data_env_logger(assets: dict, log_dir: Path, experiment: str, max_input_seq_length: int) -> dict:
    """The `data`, `env` and `logger` sections of a tiny GRPO config over `assets["train"]`."""
    return {
        "data": {
            "max_input_seq_length": max_input_seq_length,
            "num_workers": 0,
            "train": {
                "dataset_name": "ResponseDataset", "data_path": str(assets["train"]),
                "input_key": "input", "output_key": "output", "prompt_file": None,
            },
            "validation": None,
        },
        "env": {"math": {"num_workers": 1}},
        "logger": {
            "log_dir": str(log_dir),
            "monitor_gpus": False,
            "mlflow": {"tracking_uri": assets["mlflow"], "experiment_name": experiment},
        },
    }
