"""`bapo-nemo` with one function made to wait at a barrier, so a test can make a race or a late signal
happen by construction instead of hoping for the timing:

    python tests/support/barrier.py MODULE:FUNCTION DIR bapo-nemo-args...

The first call of MODULE.FUNCTION (looked up by that name at call time, as the code under test calls it)
writes DIR/arrived-<pid> and waits until DIR/go exists, then runs the real function; later calls run at
once. Nothing is replaced: the function runs as it would, only later. `Barrier` is the test's side.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
from pathlib import Path

WAIT_LIMIT_S = 600  # a test that never says go must not leave this process behind forever


def install(target: str, directory: Path) -> None:
    module_name, name = target.split(":")
    module = importlib.import_module(module_name)
    real = getattr(module, name)
    waited = []

    @functools.wraps(real)
    def wait_then_run(*args, **kwargs):
        if not waited:
            waited.append(True)
            (directory / f"arrived-{os.getpid()}").write_text("")
            deadline = time.monotonic() + WAIT_LIMIT_S
            while not (directory / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return real(*args, **kwargs)

    setattr(module, name, wait_then_run)


class Barrier:
    """The test's side: `arrived()` lists the PIDs waiting, `release()` lets them all go."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def start(self, target: str, *args: str, cwd: Path, env: dict):
        """`bapo-nemo ARGS` in a process of its own (tests/support/cli_process.py) with `target` waiting here."""
        from tests.support import cli_process

        return cli_process.start(*args, cwd=cwd, env=env,
                                 before_main=functools.partial(install, target, self.directory),
                                 exec_command=[sys.executable, str(Path(__file__).resolve()), target,
                                               str(self.directory)])

    def arrived(self) -> set[int]:
        return {int(p.name.split("-")[1]) for p in self.directory.glob("arrived-*")}

    def release(self) -> None:
        (self.directory / "go").write_text("")


if __name__ == "__main__":
    install(sys.argv[1], Path(sys.argv[2]))
    from bapo_nemo.cli import main

    sys.exit(main(sys.argv[3:]))
