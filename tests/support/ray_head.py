"""A private Ray head for the NeMo-RL CPU tests: its own ports and temp dir, stopped after, so that tests
(or two copies of the suite) on one machine never join each other's cluster."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support import ray_zygote
from tests.support.ports import free_port

START_TIMEOUT_S = 300  # a hang guard, not a timing premise: a loaded 2-core machine took 25 s at load 10
SESSION_ZYGOTE_ENV = "BAPO_TEST_RAY_ZYGOTE_SESSION"
START_ATTEMPTS = 3  # a head that dies while starting (its one chosen port taken meanwhile) is started again


def _start_command(num_cpus: int, num_gpus: int, temp_dir: str, client_port: int) -> list[str]:
    """Port 0 wherever Ray accepts it: the GCS, the dashboard agent, the dashboard and the metrics
    exporter bind a port of the kernel's choosing, so no other process on the machine can take it between
    our choice and Ray's bind. A Ray process that cannot bind its port dies, and `--block` then stops the
    whole head, possibly after it has already written its address (a CI driver once retried for ten
    minutes against a head that was gone). The Ray client server refuses 0 and would otherwise take a
    fixed 10001: it gets a free port, and _start_head waits until the head's own client server holds it."""
    return [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port=0",
        "--dashboard-agent-listen-port=0", "--dashboard-port=0", "--metrics-export-port=0",
        f"--ray-client-server-port={client_port}",
        f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
        f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
    ]


def _listens(proc: subprocess.Popen, port: int) -> bool:
    """Whether one of the head's own processes listens on `port`."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return False
    for child in children:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp")):
                return True
        except psutil.Error:  # exited meanwhile
            continue
    return False


def _log_tails(temp_dir: str, lines: int = 30) -> str:
    """The head's own output and the logs of the processes whose death stops it, to read when a start fails."""
    names = ("gcs_server.*", "ray_client_server.*", "ray_process_exit.log")
    logs = [Path(temp_dir) / "head.log", *(log for name in names for log in sorted(Path(temp_dir).glob(f"session_2*/logs/{name}")))]
    parts = []
    for log in logs:
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log}\n" + "\n".join(tail))
    return "\n".join(parts) or f"(no logs under {temp_dir})"


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _worker_zygote() -> dict:
    """The head's environment, naming in the NeMo-RL tier the warm parent its Python workers are forked from
    (tests/support/ray_zygote.py; BAPO_TEST_RAY_ZYGOTE=off starts them as Ray does)."""
    env = dict(os.environ)
    # OMP_NUM_THREADS set: Ray then leaves it as it is, so the OpenMP runtime the zygote loaded has the
    # thread count a fresh worker's would read (Ray sets it only in workers that start without it)
    if not env.get("NEMO_RL_SRC") or env.get(ray_zygote.ENV) == "off" or not env.get("OMP_NUM_THREADS"):
        return {**env, ray_zygote.ENV: "off"}
    return {**env, ray_zygote.ENV: str(_session_zygote(env))}


def share_the_session_zygote() -> None:
    """Start the session's zygote now (in the NeMo-RL tier), before this process starts one that starts a
    head of its own (a rehearsal's driver): that process's workers then fork from it too."""
    _worker_zygote()


def _session_zygote(env: dict) -> Path:
    """One zygote for every head of this test session, the rehearsals' own processes included (they find
    it in SESSION_ZYGOTE_ENV): its start is ~17 CPU-s of imports, once instead of once per head. Started by
    the first head that asks, it ends with the process that started it. A head whose environment differs
    from the one the zygote started with loses nothing: each worker the client finds differing in what
    the zygote's imports read starts as Ray starts it."""
    shared = os.environ.get(SESSION_ZYGOTE_ENV)
    if shared and ray_zygote.serving(Path(shared)):
        return Path(shared)
    socket_path = Path(tempfile.mkdtemp(prefix="z", dir="/tmp")) / "zygote.sock"  # short: a socket path's limit
    zygote = ray_zygote.start(socket_path, {**env, ray_zygote.ENV: str(socket_path)})
    atexit.register(_end_zygote, zygote, socket_path)
    os.environ[SESSION_ZYGOTE_ENV] = str(socket_path)
    return socket_path


def _end_zygote(zygote: subprocess.Popen, socket_path: Path) -> None:
    zygote.kill()  # the workers forked from it end with their heads (tests/support/ray_zygote.py)
    zygote.wait()
    print(forks_summary(socket_path), file=sys.stderr)
    shutil.rmtree(socket_path.parent, ignore_errors=True)


def forks_summary(socket_path: Path) -> str:
    """One line: how many of the session's Ray workers forked from the zygote, and why the others did not."""
    def lines(suffix: str) -> list[str]:
        path = Path(f"{socket_path}{suffix}")
        return path.read_text().splitlines() if path.is_file() else []

    declined = Counter(line.split(": ", 1)[1] for line in lines(".declined"))
    why = "; ".join(f"{count} differing in {names}" for names, count in declined.most_common())
    return (f"Ray workers of this session ({os.getpid()}): {len(lines('.forked'))} forked from the warm parent, "
            f"{sum(declined.values())} started by Ray{f' ({why})' if why else ''}")


def _start_head(num_cpus: int, num_gpus: int) -> tuple[subprocess.Popen, str, str]:
    """Starts `ray start --head --block` and waits until it is up: its address written
    (`<temp dir>/ray_current_cluster`, once its GCS and raylet run) and its client server listening.
    `--block` keeps the head's processes as its children: terminating it stops exactly them."""
    failures = []
    for attempt in range(1, START_ATTEMPTS + 1):
        temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths have a length limit
        address_file, client_port = Path(temp_dir) / "ray_current_cluster", free_port()
        env = _worker_zygote()
        with open(Path(temp_dir) / "head.log", "w") as log:
            command = _start_command(num_cpus, num_gpus, temp_dir, client_port)
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + START_TIMEOUT_S
        while proc.poll() is None and time.time() < deadline:
            address = address_file.read_text().strip() if address_file.is_file() else ""
            if ":" in address and _listens(proc, client_port):  # ":": the file is written whole
                return proc, address, temp_dir
            time.sleep(0.5)
        if proc.poll() is None:
            _stop(proc)
            raise RuntimeError(f"the Ray head did not start within {START_TIMEOUT_S} s:\n{_log_tails(temp_dir)}")
        _stop(proc)
        failures.append(f"attempt {attempt}: `ray start` exited with {proc.returncode}\n{_log_tails(temp_dir)}")
    raise RuntimeError(f"the Ray head did not start in {START_ATTEMPTS} attempts:\n" + "\n".join(failures))


@contextmanager
def private_ray_head(num_cpus: int, num_gpus: int) -> Iterator[str]:
    """Yields the head's address, also put in RAY_ADDRESS (NeMo-RL's init_ray() joins it, never another
    job's head). Logical GPUs: NeMo-RL's placement groups ask for them."""
    import ray

    proc, address, temp_dir = _start_head(num_cpus, num_gpus)  # up: its address written, its ports held
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        if ray.is_initialized():  # a body that left its driver connected
            ray.shutdown()
        _stop(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)  # a failed start keeps its logs: they are in its error
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
