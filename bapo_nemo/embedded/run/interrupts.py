"""Stop signals of the embedded trainer.

SIGTERM, SIGUSR1 (Slurm's pre-timeout signal), SIGINT and SIGHUP ask the run to stop after the current
step, with a checkpoint; a second Ctrl-C aborts at once; the exit code is `exit_status`'s. The handlers
are in place from before set-up until the MLflow run is closed, so no signal leaves the run RUNNING.
Use: `stop = StopFlag()`, `with stop.installed(): ...`, checking `stop.requested` between steps.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
# SIGUSR1 is the requeue request (Slurm's --signal=USR1@<s>, relayed by slurm/lib/run_driver.sh): the wrapper
# that sent it asked for exactly this ending, checkpoint and exit, and requeues the job when the exit is 0.
REQUEUE_SIGNAL = "SIGUSR1"


def exit_status(signal_name: str | None) -> int:
    """The exit status of a run that ended (None: finished) or stopped on `signal_name` after its
    checkpoint: 128 + the signal's number, as a shell reports a process a signal ended (130 for SIGINT, 143
    for SIGTERM, 129 for SIGHUP), so a script can tell a stopped run from a finished one; 0 for the
    requeue request."""
    if signal_name is None or signal_name == REQUEUE_SIGNAL:
        return 0
    return 128 + signal.Signals[signal_name].value


class StopFlag:
    def __init__(self):
        self.signal_name: str | None = None
        self._terminal_fds: list[int] = []  # stdout/stderr that are a terminal (known before it hangs up)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the step
        self.signal_name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            _leave_the_terminal(self._terminal_fds)
        if signum == signal.SIGINT:
            print("\nSIGINT: stopping after the current step with a checkpoint (Ctrl-C again to abort "
                  "without one)", file=sys.stderr, flush=True)

    @contextmanager
    def installed(self):
        previous = {}
        self._terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _leave_the_terminal(terminal_fds: list[int]) -> None:
    """After a hang-up every write to the closed terminal fails (EIO), which would turn a clean stop into a
    crash at the next progress-bar update: stdout and stderr that were the terminal now go to /dev/null
    (train.log keeps every line). Which ones were the terminal is known from before: a hung-up terminal no
    longer answers isatty."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in terminal_fds:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)
