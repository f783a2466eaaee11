"""The launch scripts' pieces without a Slurm cluster: helpers of slurm/lib/common.sh, the stop-request
relay of slurm/lib/run_driver.sh (with a real child process), and the sbatch refusing to run outside
Slurm. The full script runs on real Slurm daemons in test_slurm_launch.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
COMMON = REPO / "slurm" / "lib" / "common.sh"
RUN_DRIVER = REPO / "slurm" / "lib" / "run_driver.sh"


def bash(snippet: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        ["bash", "-c", f'source "{COMMON}"; {snippet}'],
        capture_output=True,
        text=True,
        env=env if env is not None else {"PATH": os.environ["PATH"]},
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize(
    ("slurm_time", "seconds"),
    [
        ("1-02:03:04", "93784"),  # 86400 + 2*3600 + 3*60 + 4
        ("02:03:04", "7384"),  # 2*3600 + 3*60 + 4
        ("03:04", "184"),  # MM:SS -> 3*60 + 4
        ("5", "300"),  # minutes
        ("2-05", "190800"),  # D-HH -> 2*86400 + 5*3600 = 172800 + 18000
        ("08:09:07", "29347"),  # leading zeros are decimal, not octal: 8*3600 + 9*60 + 7
        ("UNLIMITED", ""),
        ("NOT_SET", ""),
    ],
)
def test_duration_to_seconds(slurm_time, seconds):
    assert bash(f"duration_to_seconds '{slurm_time}'") == seconds


@pytest.mark.parametrize(
    ("seconds", "ddhhmmss"), [(93784, "01:02:03:04"), (59, "00:00:00:59"), (-5, "00:00:00:00")]
)
def test_seconds_to_nemo_rl_timeout_format(seconds, ddhhmmss):
    assert bash(f"seconds_to_ddhhmmss {seconds}") == ddhhmmss


def test_redacted_env_hides_secret_values_only():
    env = {
        "PATH": os.environ["PATH"],
        "HF_TOKEN": "hf_abc",
        "WANDB_API_KEY": "k1",
        "AWS_SECRET_ACCESS_KEY": "k2",
        "MLFLOW_TRACKING_PASSWORD": "pw",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "HF_HOME": "/data/hf",
    }
    lines = set(bash("redacted_env", env).splitlines())
    assert {
        "HF_TOKEN=***",
        "WANDB_API_KEY=***",
        "AWS_SECRET_ACCESS_KEY=***",
        "MLFLOW_TRACKING_PASSWORD=***",
        "MLFLOW_TRACKING_URI=http://mlflow:5000",
        "HF_HOME=/data/hf",
    } <= lines
    assert not any(secret in line for line in lines for secret in ("hf_abc", "k1", "k2", "pw\n"))


def test_newest_checkpoint_is_the_highest_step_directory(tmp_path):
    for name in ("step_2", "step_10", "step_9"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_11").write_text("a file, not a checkpoint")
    (tmp_path / "latest").write_text("step_10")
    # numeric, not lexical (step_9 > step_10 lexically); directories only
    assert bash(f"newest_checkpoint '{tmp_path}'") == "step_10"
    assert bash(f"newest_checkpoint '{tmp_path / 'absent'}'") == ""


# A driver that checkpoints on SIGUSR1 like the embedded trainer: it records the signal and exits 0.
# Otherwise it runs until the test creates its FINISH file (or an hour passes), then exits with argv[2].
FAKE_DRIVER = """
import signal, sys, time, pathlib
out = pathlib.Path(sys.argv[1])
finish = out.with_name("FINISH")
signal.signal(signal.SIGUSR1, lambda s, f: (out.write_text("SIGUSR1"), sys.exit(0)))
out.write_text("started")
deadline = time.time() + 3600
while not finish.exists() and time.time() < deadline:
    time.sleep(0.05)
sys.exit(int(sys.argv[2]))
"""


def run_driver(tmp_path: Path, stop_signal: str, exit_code: int):
    """The wrapper around FAKE_DRIVER, once the driver's signal handler is in place. Each test orders its
    events by what the wrapper prints (read_until), not by sleeping, so that a loaded machine changes
    nothing but the duration."""
    marker, stop_file = tmp_path / "marker", tmp_path / "STOP"
    proc = subprocess.Popen(
        ["bash", str(RUN_DRIVER), str(stop_file), stop_signal, "--", sys.executable, "-c", FAKE_DRIVER,
         str(marker), str(exit_code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    while not marker.exists():
        assert proc.poll() is None, f"the wrapper exited before the driver started: {proc.stdout.read()}"
        time.sleep(0.05)
    return proc, marker, stop_file


def read_until(proc: subprocess.Popen, text: str) -> str:
    """The wrapper's output up to and including the first line that contains `text`."""
    lines = []
    while not lines or text not in lines[-1]:
        line = proc.stdout.readline()
        assert line, f"the wrapper ended without printing {text!r}: {''.join(lines)}"
        lines.append(line)
    return "".join(lines)


def test_run_driver_relays_a_stop_request_to_the_driver(tmp_path):
    """The driver would run for an hour: only the relayed SIGUSR1 ends it (and with its own exit code
    after checkpointing, 0, not the 7 of a natural end)."""
    proc, marker, stop_file = run_driver(tmp_path, "USR1", exit_code=7)
    stop_file.touch()
    out, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, out
    assert marker.read_text() == "SIGUSR1"
    assert "sending SIGUSR1 to the driver" in out


def test_run_driver_with_signal_none_lets_the_driver_finish_and_keeps_its_exit_code(tmp_path):
    proc, marker, stop_file = run_driver(tmp_path, "none", exit_code=3)
    stop_file.touch()
    out = read_until(proc, "the driver is expected to stop on its own")  # seen while the driver runs
    (tmp_path / "FINISH").touch()
    rest, _ = proc.communicate(timeout=HANG_GUARD_S)
    out += rest
    assert proc.returncode == 3, out
    assert marker.read_text() == "started"  # never signalled
    assert "driver exited with code 3" in out


def test_run_driver_relays_nothing_after_a_sigterm(tmp_path):
    """Slurm's SIGTERM (scancel, requeue) reaches every step process, the driver included: the wrapper
    waits for the driver and does not send it a second stop signal when the stop file appears."""
    proc, marker, stop_file = run_driver(tmp_path, "USR1", exit_code=3)
    proc.terminate()  # to the wrapper only, here
    out = read_until(proc, "got SIGTERM")
    stop_file.touch()
    out += read_until(proc, "stop requested after SIGTERM: nothing sent")  # seen while the driver runs
    (tmp_path / "FINISH").touch()
    rest, _ = proc.communicate(timeout=HANG_GUARD_S)
    out += rest
    assert proc.returncode == 3, out  # the driver ran to its end: not killed, not signalled
    assert marker.read_text() == "started"
    assert "sending SIGUSR1" not in out


def test_run_driver_rejects_a_malformed_command_line():
    result = subprocess.run(
        ["bash", str(RUN_DRIVER), "stop", "USR1", "python"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2 and "usage: run_driver.sh" in result.stderr


@pytest.mark.parametrize("script", ["bapo_32b.sbatch", "bapo_7b.sbatch"])
def test_sbatch_script_refuses_to_run_outside_slurm(script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["BAPO_REPO"] = str(REPO)
    result = subprocess.run(
        ["bash", str(REPO / "slurm" / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert "not inside a Slurm job" in result.stderr


def test_the_script_requeues_the_exit_code_the_driver_gives_for_a_lost_worker():
    """slurm/bapo_32b.sbatch requeues on the NeMo-RL driver's exit code for a lost Ray worker (the Slurm test
    of it stands in for that driver, so it cannot catch the two drifting apart)."""
    import re

    from bapo_nemo.nemo.worker_watch import WORKER_LOST_EXIT

    text = (REPO / "slurm" / "bapo_32b.sbatch").read_text()
    assert re.search(r"^WORKER_LOST_EXIT=(\d+)$", text, re.MULTILINE).group(1) == str(WORKER_LOST_EXIT)
