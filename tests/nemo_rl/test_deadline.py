"""checkpoint_must_save_by from the job's real end time (bapo_nemo/nemo/deadline.py), judged with the
installed NeMo-RL's own `TimeoutChecker` (run from its source in a child process)."""

from __future__ import annotations

from bapo_nemo.nemo.deadline import ddhhmmss, save_by
from tests.support.nemo_rl_source import run_with_nemo_rl


def test_nemo_rl_timeout_checker_saves_before_the_job_ends():
    """Replay a cold attempt through v0.7.0's TimeoutChecker (clock faked inside the child): a 4 h job,
    35 min of set-up, 20 min steps, 900 s margin. With the deadline set after set-up, the checker asks for
    the save at a step end from which one more step would pass the deadline, so save and exit fit in the
    job; with the old value fixed at submission (time left - 1200 s set-up guess - 900 s), counted from
    the loop start, the save starts with less than the margin left, and is killed by the time limit."""
    job_len, setup, step, margin = 14_400, 2_100, 1_200, 900
    new = save_by(end_epoch=job_len, now=setup, margin_sec=margin)
    old = ddhhmmss(job_len - 1200 - margin)
    result = run_with_nemo_rl(
        "import nemo_rl.utils.timer as timer",
        f"""
        clock = [0.0]
        timer.time.time = lambda: clock[0]
        def save_time(value):
            clock[0] = {setup}.0  # grpo_train starts after set-up
            checker = timer.TimeoutChecker(timeout=value, fit_last_save_time=True)
            checker.start_iterations()
            while True:
                clock[0] += {step}
                checker.mark_iteration()
                if checker.check_save():
                    return clock[0]
        print(json.dumps({{"new": save_time({new!r}), "old": save_time({old!r})}}))
        """,
    )
    # Steps end at 2100 + k*1200. New deadline 11,400 s after 2,100: at 12,900 (k=9) elapsed 10,800 + mean
    # 1,200 >= 11,400 -> save at 12,900, 1,500 s before the end (>= the 900 s margin).
    assert result["new"] == 12_900 and job_len - result["new"] >= margin
    # Old deadline 12,300 s from 2,100: at 12,900 elapsed 10,800 + 1,200 < 12,300; at 14,100 elapsed
    # 12,000 + 1,200 >= 12,300 -> the save starts 300 s before the end, less than the 900 s it needs.
    assert result["old"] == 14_100 and job_len - result["old"] < margin
