"""What a process forked to stand for a fresh interpreter does last (tests/support/cli_process.py,
tests/support/ray_zygote.py)."""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_as_the_interpreter(code: int) -> None:
    """The interpreter's exit: wait for non-daemon threads, run atexit handlers, flush the streams, end with
    `code` (never returns)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
