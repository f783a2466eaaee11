"""checkpoint_must_save_by from the job's real end time, set after set-up (bapo_nemo/nemo/deadline.py); NeMo-RL's
own `TimeoutChecker` judges it in tests/nemo_rl/test_deadline.py."""

from __future__ import annotations

import pytest

from bapo_nemo.nemo.deadline import apply_job_deadline, ddhhmmss, job_end_epoch, save_by


def test_the_deadline_counts_from_now_not_from_the_job_start():
    # A job with 4 h left at its start whose set-up (download, conversion, vLLM start-up) took 35 min:
    # 14,400 - 2,100 - 900 = 11,400 s from the train loop's start.
    start, setup, margin = 1_000_000.0, 2100.0, 900.0
    config = {"checkpoint_must_save_by": None}
    env = {"BAPO_JOB_END_EPOCH": str(start + 14_400), "BAPO_SAVE_MARGIN_SEC": str(margin)}
    value = apply_job_deadline(config, env, now=start + setup)
    assert value == config["checkpoint_must_save_by"] == "00:03:10:00"  # 11,400 s = 3 h 10 min


def test_slurm_end_time_is_a_fallback_and_a_value_in_the_config_is_kept():
    config = {"checkpoint_must_save_by": None}
    assert apply_job_deadline(config, {"SLURM_JOB_END_TIME": "5000"}, now=1000.0) == ddhhmmss(5000 - 1000 - 900)
    assert apply_job_deadline(config := {"checkpoint_must_save_by": None}, {}, now=0.0) is None
    assert config["checkpoint_must_save_by"] is None
    users = {"checkpoint_must_save_by": "00:01:00:00"}  # set in the config or by an override: kept
    assert apply_job_deadline(users, {"SLURM_JOB_END_TIME": "5000"}, now=1000.0) is None
    assert users["checkpoint_must_save_by"] == "00:01:00:00"


def test_no_time_left_means_save_after_the_first_step():
    assert save_by(end_epoch=1000.0, now=900.0, margin_sec=300.0) == "00:00:00:00"


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="BAPO_JOB_END_EPOCH='soon'"):
        job_end_epoch({"BAPO_JOB_END_EPOCH": "soon"})
    with pytest.raises(ValueError, match="BAPO_SAVE_MARGIN_SEC='x'"):
        apply_job_deadline({}, {"BAPO_JOB_END_EPOCH": "10", "BAPO_SAVE_MARGIN_SEC": "x"}, now=0.0)


