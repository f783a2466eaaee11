"""slurm/lib/ray_head.sh and ray_worker.sh as they run inside the container, each step's script run for
real by bash. The Ray cluster is the boundary: `ray` is a stand-in on PATH that records each call (its
arguments, its open-file limit, the environment the Ray daemons would hand to NeMo-RL's workers), and
`python` (the head's node count) answers that every node joined. The flags themselves are checked against
the real `ray start --help`."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "slurm" / "lib"
# Port ranges NeMo-RL v0.7.0 uses (ray.sub's port layout) and the kernel's ephemeral range.
TAKEN = [(9900, 9901), (10002, 11000), (11001, 15000), (15001, 20000), (25000, 28000)]
EPHEMERAL_LOW = 32768
DAEMON_FLAGS = [
    "--node-manager-port",
    "--object-manager-port",
    "--runtime-env-agent-port",
    "--dashboard-agent-grpc-port",
    "--dashboard-agent-listen-port",
    "--metrics-export-port",
]


def fake_tools(bin_dir: Path, log: Path, nodes: int = 1) -> None:
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(
        "#!/bin/bash\n"
        f'{{ echo "CALL $1"; printf "ARG %s\\n" "$@"; echo "NOFILE $(ulimit -Sn)"; '
        f'echo "NRL_MEGATRON_CHECKPOINT_DIR ${{NRL_MEGATRON_CHECKPOINT_DIR:-}}"; }} >> "{log}"\n'
    )
    (bin_dir / "python").write_text(f"#!/bin/bash\ncat >/dev/null\necho {nodes}\n")
    for tool in ("ray", "python"):
        (bin_dir / tool).chmod(0o755)


def run_script(script: str, tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    attempt = tmp_path / "attempt"
    attempt.mkdir(exist_ok=True)
    (attempt / "driver_command.sh").write_text("exit 0\n")
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "BAPO_REPO": str(REPO),
        "ATTEMPT_DIR": str(attempt),
        "HEAD_IP": "127.0.0.1",
        "RAY_PORT": "9900",
        "RAY_CLIENT_PORT": "9901",
        "RAY_DASHBOARD_PORT": "8265",
        "RAY_MIN_WORKER_PORT": "10002",
        "RAY_MAX_WORKER_PORT": "11000",
        "GPUS_PER_NODE": "8",
        "NUM_NODES": "1",
        "RAY_JOIN_TIMEOUT": "5",
        "STOP_FILE": str(attempt / "STOP_REQUESTED"),
        "DRIVER_STOP_SIGNAL": "USR1",
        "DRIVER_COMMAND_FILE": str(attempt / "driver_command.sh"),
        **extra,
    }

    def low_soft_limit():  # a typical login default, so the raise is visible
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))

    return subprocess.run(
        ["bash", str(LIB / script)], env=env, capture_output=True, text=True, timeout=60, check=False,
        preexec_fn=low_soft_limit,
    )


def start_calls(log: Path) -> list[dict]:
    """Each recorded `ray start`: its args, open-file soft limit and NRL_MEGATRON_CHECKPOINT_DIR."""
    calls, current = [], None
    for line in log.read_text().splitlines():
        tag, _, value = line.partition(" ")
        if tag == "CALL":
            current = {"cmd": value, "args": []}
            calls.append(current)
        elif tag == "ARG":
            current["args"].append(value)
        else:
            current[tag] = value
    return [c for c in calls if c["cmd"] == "start"]


def expected_soft_limit() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 65535 if hard == resource.RLIM_INFINITY else min(65535, hard)


def daemon_ports(args: list[str]) -> dict[str, int]:
    return {a.split("=")[0]: int(a.split("=")[1]) for a in args if a.split("=")[0] in DAEMON_FLAGS}


@pytest.fixture
def shared_dir(tmp_path):
    d = tmp_path / "run" / "megatron_base"
    d.mkdir(parents=True)
    return d


@pytest.mark.parametrize("script", ["ray_head.sh", "ray_worker.sh"])
def test_ray_nodes_start_with_pinned_ports_a_raised_file_limit_and_a_shared_conversion_dir(
    script, tmp_path, shared_dir
):
    log = tmp_path / "ray.log"
    fake_tools(tmp_path / "bin", log)
    (tmp_path / "attempt").mkdir()
    (tmp_path / "attempt" / "RAY_HEAD_READY").touch()  # the worker waits for the head
    result = run_script(script, tmp_path, NRL_MEGATRON_CHECKPOINT_DIR=str(shared_dir))
    if script == "ray_head.sh":
        assert result.returncode == 0, result.stdout + result.stderr
    else:  # `ray start --block` returned: the worker step fails, so the job fails at once
        assert "Ray worker on" in result.stderr and "exited with code 0" in result.stderr
    (call,) = start_calls(log)
    assert int(call["NOFILE"]) == expected_soft_limit()
    assert call["NRL_MEGATRON_CHECKPOINT_DIR"] == str(shared_dir)
    ports = daemon_ports(call["args"])
    assert set(ports) == set(DAEMON_FLAGS)
    assert len(set(ports.values())) == len(ports)
    for flag, port in ports.items():
        assert port < EPHEMERAL_LOW, (flag, port)
        assert not any(lo <= port <= hi for lo, hi in TAKEN), (flag, port)


def test_daemon_ports_follow_the_tunables(tmp_path, shared_dir):
    log = tmp_path / "ray.log"
    fake_tools(tmp_path / "bin", log)
    result = run_script("ray_head.sh", tmp_path, NRL_MEGATRON_CHECKPOINT_DIR=str(shared_dir),
                        RAY_NODE_MANAGER_PORT="31001", RAY_METRICS_EXPORT_PORT="31011")
    assert result.returncode == 0, result.stderr
    ports = daemon_ports(start_calls(log)[0]["args"])
    assert ports["--node-manager-port"] == 31001 and ports["--metrics-export-port"] == 31011
    assert ports["--object-manager-port"] == 30003


@pytest.mark.parametrize("script", ["ray_head.sh", "ray_worker.sh"])
def test_no_ray_node_starts_without_a_shared_conversion_dir(script, tmp_path):
    log = tmp_path / "ray.log"
    fake_tools(tmp_path / "bin", log)
    (tmp_path / "attempt").mkdir()
    (tmp_path / "attempt" / "RAY_HEAD_READY").touch()
    result = run_script(script, tmp_path)
    assert result.returncode == 1
    assert "NRL_MEGATRON_CHECKPOINT_DIR is not set" in result.stderr
    missing = run_script(script, tmp_path, NRL_MEGATRON_CHECKPOINT_DIR=str(tmp_path / "absent"))
    assert missing.returncode == 1 and f"{tmp_path / 'absent'}" in missing.stderr
    assert not log.exists() or not start_calls(log)


def test_every_flag_is_one_of_ray_start():
    """The pinned-port flags exist in the installed Ray's `ray start` (the image's Ray has the same CLI)."""
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    if ray is None:
        pytest.skip("ray is not installed")
    help_text = subprocess.run(
        [ray, "start", "--help"], capture_output=True, text=True, timeout=HANG_GUARD_S, check=True
    ).stdout
    for flag in DAEMON_FLAGS:
        assert flag in help_text, flag
