"""SIGUSR1 makes NeMo-RL's per-step timeout check answer "save now" once. The base class here is a stand-in
with v0.7.0 `nemo_rl.utils.timer.TimeoutChecker`'s contract (`check_save()` and its `last_saved` flag),
because NeMo-RL needs Python 3.13; tests/nemo_rl/test_stop_signal.py uses the real class."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bapo_nemo.nemo import stop_signal


class V070LikeTimeoutChecker:
    """v0.7.0's behaviour: True once when the deadline has passed, then False (it saved already)."""

    def __init__(self, timeout_s: float | None = None):
        self.deadline = float("inf") if timeout_s is None else time.time() + timeout_s
        self.last_saved = False

    def check_save(self):
        if self.last_saved:
            return False
        if time.time() >= self.deadline:
            self.last_saved = True
            return True
        return False


def test_sigusr1_triggers_exactly_one_save(fresh_signal_state):
    checker = stop_signal.signal_aware(V070LikeTimeoutChecker)(timeout_s=None)
    stop_signal.install_stop_signal()
    assert checker.check_save() is False  # no deadline, no signal
    os.kill(os.getpid(), signal.SIGUSR1)  # the process survives: the handler replaced the default action
    time.sleep(0.05)
    assert checker.check_save() is True
    assert checker.check_save() is False  # grpo_train returns after the save; a second ask says no


def test_deadline_still_works_without_signal(fresh_signal_state):
    checker = stop_signal.signal_aware(V070LikeTimeoutChecker)(timeout_s=0.0)
    assert checker.check_save() is True and checker.check_save() is False


@pytest.mark.parametrize("stop", ["signal", "deadline"])
def test_an_early_stop_is_a_normal_end_of_the_async_loop(fresh_signal_state, stop):
    """The driver's check after async_grpo_train: fewer steps than max_num_steps is a failure unless the
    loop was told to checkpoint and stop (by the signal or by the deadline)."""
    from bapo_nemo.nemo.async_end import AsyncLoopError, check_async_loop_finished

    checker = stop_signal.signal_aware(V070LikeTimeoutChecker)(timeout_s=0.0 if stop == "deadline" else None)
    stop_signal.install_stop_signal()
    check_async_loop_finished(5, 5)  # all steps done
    assert checker.check_save() is (stop == "deadline")
    if stop == "signal":
        with pytest.raises(AsyncLoopError, match="ended after step 3 of 5 without a stop request"):
            check_async_loop_finished(3, 5)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert checker.check_save() is True
    assert stop_signal.early_stop_reached()
    check_async_loop_finished(3, 5)  # stopped early on request: no error


