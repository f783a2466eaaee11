"""A real `mlflow server` process on 127.0.0.1 (sqlite store) that a test can stop and restart."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.support.ports import free_port

MLFLOW_BIN = str(Path(sys.executable).with_name("mlflow"))


class MlflowServer:
    """A real `mlflow server` process on 127.0.0.1 that a test can stop and restart on the same port+store (the
    port is leased to this process by `free_port()`, so no other test's server takes it during an outage)."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600.0) -> None:  # a hang guard: under the whole suite a start took minutes
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        cmd = [MLFLOW_BIN, "server", "--backend-store-uri", f"sqlite:///{self.root}/server.db",
               "--artifacts-destination", str(self.root / "server_artifacts"),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
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
