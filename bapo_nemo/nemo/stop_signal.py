"""Checkpoint-and-stop on a signal for NeMo-RL v0.7.0's grpo_train.

v0.7.0 has no signal handler; its only early stop is `TimeoutChecker.check_save()` (armed by
`checkpointing.checkpoint_must_save_by`), which grpo_train asks once per step: on True it saves a
checkpoint, prints "Timeout has been reached, stopping training early" and returns. We make that check
also answer True once SIGUSR1 (Slurm's `--signal=B:USR1@...`) has arrived, so a job can checkpoint on
demand instead of relying on an estimate of the time left. grpo_train imports the class by name, so the
driver replaces `nemo_rl.algorithms.grpo.TimeoutChecker` with the subclass built here.
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()
_early_stop = threading.Event()  # check_save() said "save and stop" (signal or timeout) in this process


def stop_requested() -> bool:
    return _requested.is_set()


def early_stop_reached() -> bool:
    """Whether the train loop was told to checkpoint and stop early since the checker was installed."""
    return _early_stop.is_set()


def install_stop_signal(signum: int = signal.SIGUSR1) -> None:
    """Remember `signum` instead of dying of it (the default action of SIGUSR1 is to terminate)."""

    def handler(received, _frame):
        if not _requested.is_set():
            print(f"received signal {signal.Signals(received).name}: checkpoint after this step, then stop",
                  flush=True)
        _requested.set()

    signal.signal(signum, handler)


def signal_aware(timeout_checker_cls: type) -> type:
    """A subclass of v0.7.0's TimeoutChecker whose check_save() is also True after the stop signal."""

    class SignalAwareTimeoutChecker(timeout_checker_cls):
        def check_save(self):
            if _requested.is_set() and not self.last_saved:
                self.last_saved = True  # the parent's "save once" flag
                _early_stop.set()
                return True
            stop = super().check_save()
            if stop:
                _early_stop.set()
            return stop

    return SignalAwareTimeoutChecker


def patch_grpo_timeout_checker(grpo_module) -> None:
    """Install the handler and the signal-aware checker into `nemo_rl.algorithms.grpo` (a run starts with
    no stop asked for: a signal before this would have ended the process)."""
    install_stop_signal()
    _requested.clear()
    _early_stop.clear()
    grpo_module.TimeoutChecker = signal_aware(grpo_module.TimeoutChecker)
