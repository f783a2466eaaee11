"""A private Ray head for the NeMo-RL CPU tests: its own ports and temp dir, stopped after, so that tests
(or two copies of the suite) on one machine never join each other's cluster."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

START_TIMEOUT_S = 300  # a hang guard, not a timing premise: a loaded 2-core machine took 25 s at load 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_ray_head(num_cpus: int, num_gpus: int) -> Iterator[str]:
    """Yields the head's address, also put in RAY_ADDRESS (NeMo-RL's init_ray() joins it, never another
    job's head). Logical GPUs: NeMo-RL's placement groups ask for them. `ray start --block` keeps the
    head's processes as its children: terminating it stops exactly them. Every port Ray would otherwise
    take at a fixed default (dashboard 8265 even with the dashboard off, client server 10001, agent
    52365) is chosen free too, so a second head on the machine (another test run) never collides."""
    import ray

    port, agent_port, dashboard_port, client_port, metrics_port = (free_port() for _ in range(5))
    temp_dir = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths have a length limit
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
            f"--dashboard-agent-listen-port={agent_port}", f"--dashboard-port={dashboard_port}",
            f"--ray-client-server-port={client_port}", f"--metrics-export-port={metrics_port}",
            f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
            f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    deadline = time.time() + START_TIMEOUT_S
    try:
        while True:
            try:
                ray.init(address=address, log_to_driver=False)
                ray.shutdown()
                break
            except (ConnectionError, RuntimeError, TimeoutError):  # not up yet
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the Ray head at {address} did not start (logs: {temp_dir})") from None
                time.sleep(1)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
