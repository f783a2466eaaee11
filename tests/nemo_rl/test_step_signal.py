"""The zero-spread warning (bapo_nemo/nemo/step_signal.py) through the installed NeMo-RL's real Logger and
our MLflow set-up: once on stderr and as the run's tag."""

from __future__ import annotations

import json
from pathlib import Path


def test_three_tied_steps_warn_once_on_stderr_and_in_the_mlflow_run(tmp_path, capsys):
    """NeMo-RL v0.7.0's real Logger with our MLflow set-up: 3 steps in a row with 3/4 of the groups tied and
    every reward 0 print the warning once and set it as the run's tag; a mixed step resets the streak."""
    from mlflow.tracking import MlflowClient
    from nemo_rl.utils.logger import Logger

    from bapo_nemo.embedded.loop.step_metrics import ZERO_SPREAD_TAG
    from bapo_nemo.nemo.step_signal import warn_on_zero_spread
    from bapo_nemo.tracking.nemo_rl import RUN_FILE, after_setup, prepare_logger_config
    from tests.support.nemo_tracking import v070_config

    config = prepare_logger_config(v070_config(tmp_path))
    nemo_logger = Logger(config["logger"])
    tracker = after_setup(config, nemo_logger)
    warn_on_zero_spread(nemo_logger, lambda name, text: tracker.log_tags({name: text}))
    for step, frac in enumerate([0.75, 0.75, 0.0, 0.75, 0.75, 0.75, 0.75], start=1):
        nemo_logger.log_metrics({"reward": 0.0, "frac_reward_zero_std": frac}, step=step, prefix="train")
    nemo_logger.log_metrics({"frac_reward_zero_std": 1.0}, step=8, prefix="validation")  # not a train step

    warnings = [line for line in capsys.readouterr().err.splitlines() if "no learning signal" in line]
    assert warnings == [warnings[0]] and "steps 4-6" in warnings[0] and "every reward was 0" in warnings[0]
    run_id = json.loads((Path(config["checkpointing"]["checkpoint_dir"]) / RUN_FILE).read_text())["run_id"]
    (Path(config["checkpointing"]["checkpoint_dir"]) / "step_8").mkdir()  # MLflow gets steps a checkpoint covers
    tracker.flush()
    run = MlflowClient(config["logger"]["mlflow"]["tracking_uri"]).get_run(run_id)
    assert run.data.tags[ZERO_SPREAD_TAG] == warnings[0].removeprefix("warning: ")
    assert run.data.metrics["train/frac_reward_zero_std"] == 0.75
