"""Checkpoint-and-stop on SIGUSR1 (Slurm's `--signal=B:USR1@...`) in NeMo-RL's GRPO loops.

The loops' only early stop is `TimeoutChecker.check_save()`, asked once per step: on True they save a
checkpoint and return. The subclass built here also answers True once the signal has arrived, so a job
checkpoints on demand instead of on an estimate of the time left; the driver puts it in place of
`nemo_rl.algorithms.grpo.TimeoutChecker`, which the loops look up by name (layers.py).
"""

from __future__ import annotations

import signal
import threading

_requested = threading.Event()
_early_stop = threading.Event()  # check_save() said "save and stop" (signal or timeout) in this process


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
    """A subclass of NeMo-RL's TimeoutChecker whose check_save() is also True after the stop signal."""

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
