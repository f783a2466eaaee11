"""`bapo-nemo ARGS` as a process of its own for the tests, forked from a warm server instead of started as
a fresh interpreter.

Why: every `python -m bapo_nemo.cli` pays ~5 CPU-s of imports (torch, transformers -> torch._dynamo and
scikit-learn, mlflow) before the code under test runs, and the suite starts about a hundred; on a 2-core CI
machine that was a third of the suite. Here multiprocessing's forkserver (one per test worker) imports
those modules once, and each call forks it.

What the forked process shares with `python -m bapo_nemo.cli ARGS` run from a shell: its own PID, working
directory, environment (`os.environ` is the one given), stdout and stderr (files the test reads back),
stdin (/dev/null), default signal dispositions, `sys.argv`, `sys.path[0]` (the working directory, as `-m`
puts it), `bapo_nemo.cli.main` with its exit status, and the interpreter's exit work (non-daemon threads
joined, atexit handlers run). What it skips is only the interpreter start and those imports; the tests
that start the CLI with exec (tests/cli/test_cli_startup.py, the umask, terminal and Slurm tests, the README
command) keep those covered. A call whose environment differs from the server's in a variable that modules read when
they are imported (HF_*, TORCH*, OMP_*, PYTHON*: anything not in `_READ_AT_CALL_TIME`) is run with exec,
as is every call when BAPO_TEST_EXEC_CLI=1 (to rule this out when a test fails).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.support.forked_process import exit_as_the_interpreter

REPO = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "bapo_nemo.cli"]

# What the server imports before it forks: what a `bapo-nemo` call spends its start-up on.
_PRELOAD = [
    "bapo_nemo.cli",
    "bapo_nemo.embedded.run.train_cli",
    "bapo_nemo.embedded.run.trainer",
    "bapo_nemo.embedded.model.policy",
    "bapo_nemo.embedded.output.checkpoint",
    "bapo_nemo.tracking.mlflow_tracker",
    "mlflow",
    "bapo_nemo.export.cli",
    "bapo_nemo.plan.check_cli",
]
# Variables that may differ from the server's: nothing reads them while being imported (mlflow reads its
# MLFLOW_* when called; pytest sets PYTEST_CURRENT_TEST per test; the tokenizers library reads
# TOKENIZERS_PARALLELISM when it first runs; PYTHONPATH only decides where modules come from, and the
# server's sys.path already holds this checkout).
_READ_AT_CALL_TIME = ("MLFLOW_", "SLURM_", "BAPO_", "PYTEST_")
_READ_AT_CALL_TIME_EXACT = {"TOKENIZERS_PARALLELISM", "PYTHONUNBUFFERED", "PYTHONPATH", "PWD", "OLDPWD"}

_server_env: dict[str, str] | None = None


def cli_env(extra: dict | None = None) -> dict:
    """The environment a test's `bapo-nemo` call gets: the test's own, this checkout importable."""
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **(extra or {})}


def run(*args: str, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python -m bapo_nemo.cli ARGS` in `cwd` with exactly `env`, to its end; like `subprocess.run` with
    `capture_output=True, text=True, check=False`."""
    process = start(*args, cwd=cwd, env=env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def start(*args: str, cwd: Path, env: dict, before_main: Callable[[], None] | None = None,
          exec_command: list[str] | None = None) -> CliProcess | subprocess.Popen:
    """`python -m bapo_nemo.cli ARGS` started in `cwd` with exactly `env`; the handle answers as a
    `subprocess.Popen` with text stdout/stderr pipes does (pid, poll, wait, send_signal, kill, communicate;
    `stdout`/`stderr` are read once it has exited). `before_main` (picklable) runs in the new process just
    before the CLI, and `exec_command` is the program that does the same when exec is used (tests/support/barrier.py)."""
    if not _can_fork(env):
        return subprocess.Popen([*(exec_command or COMMAND), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return CliProcess(list(args), cwd, env, before_main)


class CliProcess:
    """One forked `bapo-nemo` call (see the module's docstring)."""

    def __init__(self, args: list[str], cwd: Path, env: dict, before_main: Callable[[], None] | None = None):
        self.args = [*COMMAND, *args]
        self._output = tempfile.TemporaryDirectory(prefix="bapo-cli-")
        self._paths = Path(self._output.name, "stdout"), Path(self._output.name, "stderr")
        for path in self._paths:
            path.touch()
        self._process = _context().Process(target=_child_main, name="bapo-nemo",
                                           args=(args, str(cwd), env, *map(str, self._paths), before_main))
        self._process.start()
        self.pid = self._process.pid
        self.stdout = self.stderr = None

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        if self._process.exitcode is not None:
            self._collect()
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self._collect()
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _collect(self) -> None:
        """What the process wrote, as the pipes of a `Popen` hold it once the process has ended."""
        if self.stdout is None:
            self.stdout, self.stderr = (io.StringIO(path.read_text(errors="replace")) for path in self._paths)
            self._output.cleanup()


def _can_fork(env: dict) -> bool:
    return os.environ.get("BAPO_TEST_EXEC_CLI") != "1" and not read_at_import_and_differing(env)


def read_at_import_and_differing(env: dict) -> list[str]:
    """The variables in which `env` differs from the server's that modules may read when imported: a call
    with any of them is exec'd."""
    server_env = _server_env if _server_env is not None else dict(os.environ)
    differing = {key for key in set(env) | set(server_env) if env.get(key) != server_env.get(key)}
    return sorted(key for key in differing
                  if key not in _READ_AT_CALL_TIME_EXACT and not key.startswith(_READ_AT_CALL_TIME))


def _context():
    global _server_env
    context = multiprocessing.get_context("forkserver")
    if _server_env is None:  # the server starts with the next Process and inherits this environment
        context.set_forkserver_preload(_PRELOAD)
        _server_env = dict(os.environ)
    return context


def _child_main(args: list[str], cwd: str, env: dict, stdout_path: str, stderr_path: str,
                before_main: Callable[[], None] | None) -> None:
    """In the forked process: become `python -m bapo_nemo.cli ARGS` and exit with its status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout_path, os.O_WRONLY),
                            (2, stderr_path, os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    # the streams a fresh interpreter makes for files: stdout block-buffered, stderr line-buffered
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in a fresh interpreter
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    import bapo_nemo.cli

    sys.argv = [bapo_nemo.cli.__file__, *args]
    sys.path.insert(0, cwd)
    try:
        if before_main is not None:
            before_main()
        code = bapo_nemo.cli.main(args)
    except SystemExit as exc:  # argparse's exits (usage errors, --help)
        code = exc.code
    except BaseException:  # noqa: BLE001 - what the interpreter does with an exception that reaches the top
        import traceback

        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    exit_as_the_interpreter(code)
