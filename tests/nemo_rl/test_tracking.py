"""NeMo-RL side of tracking through the installed NeMo-RL's real `Logger`/`MLflowLogger`: secrets redacted,
a resumed run found again and journaled, its params kept when the config changes."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from bapo_nemo.tracking.nemo_rl import RUN_FILE, after_setup, prepare_logger_config
from bapo_nemo.tracking.redact import REDACTED
from tests.support.nemo_tracking import v070_config


def test_real_v070_mlflow_logger_redacts_resumes_and_journals(tmp_path):
    """Inside nvcr.io/nvidia/nemo-rl:v0.7.0: the real Logger/MLflowLogger with our configuration."""
    import mlflow
    from nemo_rl.utils.logger import Logger

    config = prepare_logger_config(v070_config(tmp_path))
    nemo_logger = Logger(config["logger"])
    nemo_logger.log_hyperparams(config)
    after_setup(config, nemo_logger)
    (Path(config["checkpointing"]["checkpoint_dir"]) / "step_1").mkdir()  # step 1's metrics go once it exists
    nemo_logger.log_metrics({"reward": 1.0, "approx_entropy": 0.3}, step=1, prefix="train")
    run_id = json.loads((Path(config["checkpointing"]["checkpoint_dir"]) / RUN_FILE).read_text())["run_id"]
    client = MlflowClient(config["logger"]["mlflow"]["tracking_uri"])
    run = client.get_run(run_id)
    assert run.data.params["env.math.judge_api_key"] == REDACTED
    assert run.data.metrics["train/reward"] == 1.0
    mlflow.end_run()
    resumed = Logger(prepare_logger_config(v070_config(tmp_path))["logger"])
    assert resumed.loggers[-1].run_id == run_id
    mlflow.end_run()


def test_resumed_run_keeps_its_params_when_the_config_changes(tmp_path):
    """v0.7.0's MLflowLogger.log_hyperparams on a resumed run whose config differs (every resume: the
    driver's log_dir becomes the next exp_NNN): MLflow refuses changed params, so only new keys are
    logged and the changed ones keep their first value."""
    import mlflow
    from nemo_rl.utils.logger import Logger

    config = prepare_logger_config(v070_config(tmp_path))
    first = Logger(config["logger"])
    first.log_hyperparams({"logger": {"log_dir": "logs/exp_001"}, "grpo": {"max_num_steps": 3}})
    run_id = first.loggers[-1].run_id
    mlflow.end_run()
    resumed_config = dict(config)
    resumed_config["logger"] = {**config["logger"], "mlflow": {**config["logger"]["mlflow"], "run_id": run_id}}
    resumed = Logger(resumed_config["logger"])
    resumed.log_hyperparams({"logger": {"log_dir": "logs/exp_002"}, "grpo": {"max_num_steps": 3, "seed": 1}})
    params = MlflowClient(config["logger"]["mlflow"]["tracking_uri"]).get_run(run_id).data.params
    assert params["logger.log_dir"] == "logs/exp_001"
    assert params["grpo.seed"] == "1" and params["grpo.max_num_steps"] == "3"
    mlflow.end_run()
