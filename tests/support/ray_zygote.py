"""A warm parent for the Ray workers of a test's private head: it imports torch, transformers, megatron-core
and the other packages most workers import (PRELOAD) once, and every Ray worker process the head starts is
forked from it instead of importing them again.

Why: on the CI's 2 cores the NeMo-RL tier's CPU is mostly Ray workers starting (about 150 per tree: policy,
generation, initializer, environment and buffer actors), each importing torch, transformers (and through
it scikit-learn and torchvision) in a fresh interpreter: 4-5 CPU-s before its own code runs, and
megatron-core another 2-3 in each policy worker.

How (tests/support/nemo_rl_shim/ray_zygote_client.py is the other half): the head is started with
BAPO_TEST_RAY_ZYGOTE naming this server's socket. Every Python process starts by importing the shim's
sitecustomize; in a Ray worker (`python .../ray/_private/workers/default_worker.py ARGS`) it hands its
arguments, environment, working directory and standard streams to this server and waits. The server forks
a helper, which forks the worker: the worker becomes `default_worker.py ARGS` (`__main__`, `sys.argv`,
`sys.path[0]`, environment, streams, signal dispositions, exit work as in a fresh interpreter) and
registers with Ray under its own pid, so Ray's kills, the tests' SIGKILLs and Ray's death reports reach it
as they would a worker Ray started itself. The helper relays the client's signals and the worker's exit
status; if the client dies the worker is killed.

What must hold for a fork to be that worker: nothing imported here reads a variable in which the worker's
environment differs from this server's (the client hands over only when the differences are in
`ray_zygote_client.SAFE_TO_DIFFER` and none of them was looked up by Python code during the imports: the
server notes those), what the imports set in the environment set in the worker too, the same interpreter
and flags, and Ray's own C++ library not loaded here (it reads RAY_JOB_ID and its config from the
environment when loaded: asserted at start-up).
One server serves every head of a test session (tests/support/ray_head.py starts it with the first).
BAPO_TEST_RAY_ZYGOTE=off (or unset) starts every worker as Ray does.
"""

from __future__ import annotations

import array
import ctypes
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.support.forked_process import exit_as_the_interpreter

ENV = "BAPO_TEST_RAY_ZYGOTE"
# What the workers import before their own code runs (measured: the modules most of a tree's ~150 workers
# imported after the fork), except Ray and NeMo-RL, which import Ray's C++ library. megatron-core is ~2 CPU-s
# of each policy worker's start; the rest ~1-2 CPU-s of every worker's. Not numba (17 workers import it):
# its import looks up COLUMNS and LINES, in which the workers differ, so none would be forked.
PRELOAD = ("torch", "transformers", "transformers.video_utils", "transformers.generation.candidate_generator",
           "transformers.modeling_utils", "transformers.convert_slow_tokenizer", "math_verify",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.pipeline_parallel", "datasets", "tensordict", "hydra", "omegaconf", "pydantic",
           "fastapi", "uvicorn", "zmq", "aiohttp", "requests", "jsonschema", "google.protobuf")
READY_TIMEOUT_S = 300  # a hang guard: a loaded 2-core machine


def description_path(socket_path: str | Path) -> Path:
    """What the client compares before handing over: this server's interpreter, flags and environment."""
    return Path(f"{socket_path}.json")


def serving(socket_path: str | Path) -> bool:
    """Whether the server for `socket_path` is up: its description written, its process alive."""
    try:
        os.kill(json.loads(description_path(socket_path).read_text())["pid"], 0)
    except (OSError, ValueError, KeyError):
        return False
    return True


def start(socket_path: Path, env: dict) -> subprocess.Popen:
    """The server for `socket_path`, started with `env` (the head's) and ready (its description written)."""
    with open(f"{socket_path}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.ray_zygote", str(socket_path)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    deadline = time.time() + READY_TIMEOUT_S
    while not description_path(socket_path).is_file():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the Ray worker zygote did not start:\n{Path(f'{socket_path}.log').read_text()[-3000:]}")
        time.sleep(0.2)
    return proc


class _RecordingEnviron(os._Environ):
    """os.environ, noting each name looked up (`os.environ[k]`, `.get`, `in`, `os.getenv`). A scan of the
    whole environment (tqdm reads its TQDM_* options so) is not a lookup."""

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def items(self):
        return {self.decodekey(k): self.decodevalue(v) for k, v in self._data.items()}.items()

    def copy(self):
        return dict(self.items())


def _import_noting_environment_reads(names) -> set[str]:
    """Import `names`; the environment variables Python code looked up meanwhile (C++ getenv is not seen)."""
    real = os.environ
    recording = object.__new__(_RecordingEnviron)
    recording.__dict__.update(real.__dict__)  # the same variables: writes reach both and the process's
    recording.read = set()
    os.environ = recording  # noqa: B003 - the same variables, read through a recorder (not a new environment)
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        os.environ = real  # noqa: B003
    return {key for key in recording.read if isinstance(key, str)}


def serve(socket_path: str) -> None:
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG: it ends with whoever started it
    env_before = dict(os.environ)
    read_at_import = _import_noting_environment_reads(PRELOAD)
    # what the imports set (scikit-learn: KMP_INIT_AT_FORK), a fresh worker's imports set too
    set_at_import = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
    assert "ray._raylet" not in sys.modules, "ray's C++ library must not be loaded before the fork"
    if "megatron.core" in sys.modules:  # its tensor loader pickled as torch's, as in a Megatron test worker
        from tests.support.nemo_rl_shim.megatron_cpu import pickled_under_torchs_name

        pickled_under_torchs_name()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the helpers are reaped by the kernel
    description = {"pid": os.getpid(), "executable": sys.executable, "flags": list(sys.flags), "env": env_before,
                   "read_at_import": sorted(read_at_import), "set_at_import": set_at_import}
    tmp = description_path(socket_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(description))
    tmp.rename(description_path(socket_path))
    while True:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _helper(conn, set_at_import)
        conn.close()


def _helper(conn: socket.socket, set_at_import: dict) -> None:
    """Fork the worker, tell the client its pid, relay signals, report its exit status."""
    try:
        request, fds = _receive(conn)
        pid = os.fork()
        if pid == 0:
            conn.close()
            _become_worker(request, fds, set_at_import)
        for fd in fds:
            os.close(fd)
        conn.sendall(struct.pack("!i", pid))
        watch = selectors.DefaultSelector()
        watch.register(conn, selectors.EVENT_READ)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                return
            if watch.select(timeout=0.2):
                signum = conn.recv(4)
                if not signum:  # the client is gone: so is its worker
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    return
                os.kill(pid, struct.unpack("!i", signum)[0])
    except OSError:
        pass
    finally:
        os._exit(0)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    head, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    (size,) = struct.unpack("!i", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise OSError("the client went away")
        body += chunk
    return json.loads(body), list(fds)


def _become_worker(request: dict, fds: list[int], set_at_import: dict) -> None:
    """In the forked worker: become `python SCRIPT ARGS` as the client was started, after the imports it would
    have done, and exit with its status."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(set_at_import)
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the streams a fresh interpreter makes for files: stdout block-buffered, stderr line-buffered
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python SCRIPT` puts it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an exception that reaches the top
        import traceback

        traceback.print_exc()
        code = 1
    exit_as_the_interpreter(code)


if __name__ == "__main__":
    serve(sys.argv[1])
