"""The client half of tests/support/ray_zygote.py (read its docstring): run from sitecustomize in a Ray
worker's interpreter, before anything is imported, it has the zygote fork this worker and then stands for
it until it exits. Returns without doing anything when the handover would not give the same worker."""

import array
import json
import os
import signal
import socket
import struct
import sys

WORKER_SCRIPT = os.path.join("ray", "_private", "workers", "default_worker.py")
# Variables a worker's environment may have other than the zygote's: Ray's own, set per worker, and those
# NeMo-RL passes on from its driver or sets per actor (loggers, venvs, ranks), unless the zygote's imports
# read it (it lists what its Python code read; C++ reads are these lists' premise). Any other difference
# starts the worker as Ray does.
SAFE_TO_DIFFER_PREFIXES = ("RAY_", "NCCL_", "NVTE_", "VLLM_", "NRL_", "BAPO_", "PYTEST_", "MLFLOW_", "SWANLAB_",
                           "WANDB_", "UV_")
# TORCH_CUDA_ARCH_LIST and TORCHINDUCTOR_CACHE_DIR are read when torch builds or compiles, not when imported;
# the KMP_* are Intel OpenMP's (torch here loads GNU's libgomp).
SAFE_TO_DIFFER = {"CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST", "TORCHINDUCTOR_CACHE_DIR", "KMP_INIT_AT_FORK",
                  "KMP_DUPLICATE_LIB_OK", "SPT_NOENV", "AVAILABLE_ADDR_LIST", "AVAILABLE_PORT_LIST", "MASTER_ADDR",
                  "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                  "PYTHONBREAKPOINT", "VIRTUAL_ENV", "COLUMNS", "LINES", "PWD", "OLDPWD", "_"}

# Set by the zygote's imports only where unset, each to a fixed default (scikit-learn's
# os.environ.setdefault of the two KMP_*, torch inductor's cache_dir()): a worker that holds that default
# (NeMo-RL hands every actor its driver's environment, where the same imports set it) would find it so.
SET_ONLY_WHERE_UNSET = {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR"}


def hand_over_if_asked() -> None:
    socket_path = os.environ.get("BAPO_TEST_RAY_ZYGOTE", "off")
    if socket_path == "off" or not sys.argv or not sys.argv[0].endswith(WORKER_SCRIPT):
        return
    try:
        with open(f"{socket_path}.json") as f:
            zygote = json.load(f)
    except OSError:
        return
    if zygote["executable"] != sys.executable or zygote["flags"] != list(sys.flags):
        return
    differing = unsafe_differences(zygote, os.environ)
    if differing:
        _note_declined(socket_path, differing)
        return
    _stand_for_the_worker(socket_path)


def unsafe_differences(zygote: dict, worker_env) -> list[str]:
    """The variables in which the worker's environment differs from the zygote's (its description: `env`
    before its imports, what they read and set) and the fork would show."""
    zygote_env, read = zygote["env"], set(zygote["read_at_import"])
    differing = {k for k in set(zygote_env) | set(worker_env) if zygote_env.get(k) != worker_env.get(k)}
    safe = {k for k in differing if k in SAFE_TO_DIFFER or k.startswith(SAFE_TO_DIFFER_PREFIXES)}
    # a default the zygote's imports set, which the worker holds already (its driver had imported the same)
    defaults = {k for k in differing & SET_ONLY_WHERE_UNSET if worker_env.get(k) == zygote["set_at_import"].get(k)}
    return sorted(differing - (safe - read) - defaults)


def _note_declined(socket_path: str, differing: list[str]) -> None:
    """One line per worker started as Ray does, in `<socket>.declined`: the variables that made the fork unsafe."""
    _note(f"{socket_path}.declined", " ".join(differing))


def _note(path: str, line: str) -> None:
    try:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}: {line}\n")
    except OSError:
        pass


def _stand_for_the_worker(socket_path: str) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:
        return  # no zygote (its head is stopping): start as Ray does
    body = json.dumps({"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    conn.sendmsg([struct.pack("!i", len(body))],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    conn.sendall(body)
    _note(f"{socket_path}.forked", "forked")

    def relay(signum, frame):
        conn.sendall(struct.pack("!i", signum))

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT):
        signal.signal(signum, relay)
    _read_int(conn)  # the worker's pid: Ray learns it when the worker registers
    code = _read_int(conn)
    if code is None:
        os._exit(1)
    if code < 0:  # killed by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _read_int(conn: socket.socket):
    data = b""
    while len(data) < 4:
        try:
            chunk = conn.recv(4 - len(data))
        except InterruptedError:
            continue
        if not chunk:
            return None
        data += chunk
    return struct.unpack("!i", data)[0]
