"""One training process per output directory.

`<output_dir>/.lock` is held with an exclusive `flock` for the life of the run; the kernel releases it
however the process ends, so a lock file left by a dead process is stale by construction and taken over.
The file records the holder's PID, host and start time for the refusal message. An output directory
inside another run's is refused before anything is written (that run's pruning or resume would delete it).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Self

LOCK_FILE = ".lock"
# Beside the lock file, any of these makes a directory a run's output directory.
RUN_FILES = ("train.log", "mlflow_run_id", "checkpoints")


class OutputDirError(RuntimeError):
    """The output directory cannot hold a run; the message names it and what to choose instead."""


class OutputDirLockedError(OutputDirError):
    """Another live process trains into the same output directory."""


def enclosing_run(path: Path) -> Path | None:
    """The nearest directory above ``path`` that is a run's output directory, or None."""
    for parent in path.resolve().parents:
        if (parent / LOCK_FILE).is_file() and any((parent / name).exists() for name in RUN_FILES):
            return parent
    return None


def check_output_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise OutputDirError(f"--output-dir {path} is a file, not a directory: choose a directory (it is created "
                             "when missing)")
    run = enclosing_run(path)
    if run is not None:
        raise OutputDirError(
            f"--output-dir {path} is inside the output directory of another run, {run}: its checkpoint pruning "
            f"or its next --resume would delete what this run writes there. Choose a directory outside it, e.g. "
            f"{run.parent / (path.name + '_run')}"
        )


class OutputDirLock:
    """`with OutputDirLock(dir) as lock:` holds the lock; `lock.stale` describes a dead previous holder."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.stale: dict | None = None
        self._fd: int | None = None

    def acquire(self) -> Self:
        check_output_dir(self.path.parent)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # a file stands where a parent directory should be
            raise OutputDirError(f"--output-dir {self.path.parent}: a file stands on its path; choose another "
                                 "directory") from None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = (f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}" if holder
                   else "another process")
            raise OutputDirLockedError(
                f"{self.path.parent} is in use by {who} (started {holder.get('started', '?')}; lock file "
                f"{self.path}): wait for it to finish, stop it, or choose another --output-dir"
            ) from None
        previous = _read_holder(fd)
        # A record left behind means its writer ended without releasing: it died (the lock is ours now).
        self.stale = previous or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # Empty the record before unlocking: an empty file means the last holder ended cleanly.
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
