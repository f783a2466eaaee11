"""A real `mlflow server` process on 127.0.0.1 (sqlite store) that a test can stop and restart."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support.ports import free_port

MLFLOW_BIN = str(Path(sys.executable).with_name("mlflow"))


class MlflowServer:
    """A real `mlflow server` process on 127.0.0.1 that a test can stop and restart on the same port+store."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._holder: socket.socket | None = None
        self._hold_port()

    def _hold_port(self) -> None:
        """While no server runs, the port is bound here but not listened on: a client is refused, as by a
        server that is down, and `free_port()` (whose probe binds without SO_REUSEADDR) never hands it to
        another test's server (one took it during an outage, and the restart's health check read a gRPC
        server's answer). Right after a stop the server's closed connections may hold the port in
        TIME_WAIT, which only a SO_REUSEADDR bind may share; the hold still refuses every probe."""
        if self._holder is not None:
            return
        holder = socket.socket()
        try:
            holder.bind(("", self.port))
        except OSError:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("", self.port))
        self._holder = holder

    def _release_port(self) -> None:
        if self._holder is not None:
            self._holder.close()
            self._holder = None

    def start(self, timeout_s: float = 600.0) -> None:  # a hang guard: under the whole suite a start took minutes
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        cmd = [MLFLOW_BIN, "server", "--backend-store-uri", f"sqlite:///{self.root}/server.db",
               "--artifacts-destination", str(self.root / "server_artifacts"),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        self._release_port()  # the server binds it next (its start-up is the one window left)
        with open(self.root / "server.log", "ab") as server_log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, env=env, stdout=server_log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (OSError, http.client.HTTPException):  # not up yet (or, loudly below, not ours)
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.proc is None:
            self._hold_port()
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
        self._hold_port()
