"""SIGUSR1 makes the installed NeMo-RL's real `TimeoutChecker` answer "save now" once."""

from __future__ import annotations

import os
import signal
import time

from bapo_nemo.nemo import stop_signal


def test_real_timeout_checker_saves_on_signal(fresh_signal_state):
    from nemo_rl.algorithms import grpo

    original = grpo.TimeoutChecker
    try:
        stop_signal.patch_grpo_timeout_checker(grpo)
        checker = grpo.TimeoutChecker(timeout="01:00:00:00", fit_last_save_time=True)
        checker.start_iterations()
        assert checker.check_save() is False
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert checker.check_save() is True and checker.check_save() is False
    finally:
        grpo.TimeoutChecker = original
