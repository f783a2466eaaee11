"""The fault rehearsal's attempts, one after the other, in a process of their own:
`python -m tests.support.nemo_fault_rehearsal_run SPEC.json` (tests/nemo_rl/test_fault_rehearsal.py starts it and reads back
what it writes; a process of its own for the reason tests/support/nemo_megatron_rehearsal_run.py gives).

One Ray head, one MLflow server and one checkpoint directory (a small tmpfs) serve every attempt; each
attempt is the same command (`python -m bapo_nemo.train --config CONFIG`) as a requeue would run it, with
faults injected at points the run reaches by construction (tests/support/nemo_faults.py for the workers' points; the
driver's points are its Nth `Policy.train` call). Five attempts, every later one resuming:

  1 policy worker 1 SIGKILLed in the middle of its 2nd train()                     -> step 2 lost
  2 a generation worker SIGKILLed mid-batch, armed at the 1st train               -> step 3 lost
  3 the newest checkpoint (step_2) damaged before the start (a shard cut to half): resumes from step_1;
    the checkpoint disk (a small tmpfs) filled at the 2nd train                     -> step 3's save fails
  4 space freed; the driver SIGKILLed (a lost node) at its 2nd train, in a process of its own
  5 the MLflow server down from the 1st train to the 2nd; SIGUSR1 sent by policy worker 0 while it writes
    the checkpoint after the 1st train                                              -> stops after the next step

SPEC.json: {"root", "config", "num_gpus"}. Writes root/attempts.json: per attempt its exit code, seconds,
the lines it printed that start with "error:" or name a damaged checkpoint or a regeneration, and the
checkpoints after it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.nemo_faults import ATTEMPT_ENV, DRIVER_PID_ENV, FAULT_ENV
from tests.support.nemo_megatron_rehearsal_run import new_driver_calls, run_driver, upstream_seams
from tests.support.ray_head import private_ray_head

TMPFS_BYTES = 48 * 2**20
WORKER_TITLES = ("CPUMegatronPolicyWorker", "CPUEngineVllmGenerationWorker")
DISK_FULL_RESERVE = 4096  # what the filler leaves free: less than any checkpoint file


class Tee(io.TextIOBase):
    """An attempt's output: kept for the test and still shown in the log."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, s):
        self.text.append(s)
        return self.stream.write(s)

    def flush(self):
        self.stream.flush()


def mount_tmpfs(directory: Path) -> str:
    """A small tmpfs as the checkpoint directory (the disk-full fault); returns how, or why not."""
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(directory)],
                          capture_output=True, text=True, check=False)
    return "mounted" if done.returncode == 0 else f"refused: {done.stderr.strip() or done.returncode}"


def fill_disk(directory: Path) -> Path:
    """Everything but DISK_FULL_RESERVE bytes of `directory`'s filesystem taken by one file."""
    free = shutil.disk_usage(directory).free
    filler = directory / "filler.bin"
    with open(filler, "wb") as f:
        f.truncate(0)
        chunk = b"\0" * 2**20
        left = max(0, free - DISK_FULL_RESERVE)
        while left > 0:
            left -= f.write(chunk[: min(len(chunk), left)])
    return filler


def damage_newest(checkpoints: Path) -> dict:
    """Cut the largest shard of the newest checkpoint to half its size."""
    newest = max((p for p in checkpoints.glob("step_*")), key=lambda p: int(p.name.split("_")[1]))
    shard = max(newest.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    return {"checkpoint": str(newest), "shard": str(shard), "size": size}


def workers_gone(guard_s: float = 120.0) -> float:
    """Seconds until no stand-in worker process is left (Ray ends a dead driver's actors)."""
    import psutil

    started = time.time()
    while time.time() - started < guard_s:
        alive = [p for p in psutil.process_iter(["cmdline"]) if any(
            t in " ".join(p.info["cmdline"] or []) for t in WORKER_TITLES)]
        if not alive:
            return time.time() - started
        time.sleep(0.5)
    raise RuntimeError(f"the killed driver's workers still run after {guard_s} s: {alive}")


def attempt(root: Path, config: Path, uri: str, calls: dict, name: str, fault: dict | None,
            on_train: dict[int, Callable[[], None]], record: list) -> None:
    """One driver run in this process with `fault` planned and `on_train[k]` run at its k-th train call."""
    os.environ[FAULT_ENV] = json.dumps(fault) if fault else ""
    os.environ[ATTEMPT_ENV] = str(len(record) + 1)
    seen = []

    def at_train():
        seen.append(True)
        if len(seen) in on_train:
            on_train[len(seen)]()

    calls["on_train"][:] = [at_train]
    started, tee, out = time.time(), Tee(sys.stderr), Tee(sys.stdout)
    with contextlib.redirect_stderr(tee), contextlib.redirect_stdout(out):
        try:
            rc = run_driver(config, calls["built"], [f"++logger.mlflow.tracking_uri={uri}"])
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    record.append(outcome(root, name, rc, started, "".join(out.text + tee.text), len(seen)))


def outcome(root: Path, name: str, rc: int, started: float, stderr: str, train_calls: int) -> dict:
    lines = [x for x in stderr.splitlines() if x.startswith("error:") or "is damaged" in x or "generated again" in x
             or "Timeout has been reached" in x]
    return {"name": name, "rc": rc, "seconds": round(time.time() - started, 1), "lines": lines,
            "train_calls": train_calls,
            "checkpoints": sorted(p.name for p in (root / "checkpoints").iterdir())}


def driver_in_its_own_process(root: Path, spec_path: Path, uri: str, record: list) -> None:
    """The driver SIGKILLs itself at its 2nd train call (the process a lost node takes)."""
    started = time.time()
    log = root / "attempt4.log"
    os.environ[ATTEMPT_ENV] = str(len(record) + 1)
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "tests.support.nemo_fault_rehearsal_run", str(spec_path), "--kill-driver", uri],
                              stdout=out, stderr=subprocess.STDOUT, check=False)
    entry = outcome(root, "driver killed", done.returncode, started, log.read_text(), -1)
    entry["workers_gone_s"] = round(workers_gone(), 1)
    record.append(entry)


def kill_driver_attempt(spec: dict, uri: str) -> None:
    root, config = Path(spec["root"]), Path(spec["config"])
    calls = new_driver_calls()
    with upstream_seams(root / "record", calls, engine=True):
        calls["on_train"].append(lambda: len(calls["train"]) == 2 and os.kill(os.getpid(), signal.SIGKILL))
        run_driver(config, calls["built"], [f"++logger.mlflow.tracking_uri={uri}"])


def rehearse(spec: dict, spec_path: Path) -> None:
    from tests.support.mlflow_server import MlflowServer

    root, config = Path(spec["root"]), Path(spec["config"])
    checkpoints = root / "checkpoints"
    tmpfs = mount_tmpfs(checkpoints)
    os.environ[DRIVER_PID_ENV] = str(os.getpid())
    # A hang guard for the server's answers, not the outage's detection (a stopped server refuses at once):
    # on a loaded 2-core machine its one worker took over 5 s, the product's default, to answer at set-up.
    os.environ.update(MLFLOW_HTTP_REQUEST_TIMEOUT="120", MLFLOW_HTTP_REQUEST_MAX_RETRIES="2")
    server = MlflowServer(root / "mlflow")
    (root / "mlflow").mkdir(exist_ok=True)
    server.start()
    record: list = []
    calls = new_driver_calls()
    marker = lambda name: str(root / f"fired_{name}")
    facts: dict = {"tmpfs": tmpfs, "mlflow": server.uri}
    try:
        with private_ray_head(num_cpus=24, num_gpus=spec["num_gpus"]), upstream_seams(
                root / "record", calls, engine=True):
            attempt(root, config, server.uri, calls, "policy worker killed",
                    {"at": "policy.train", "rank": 1, "call": 2, "do": "kill", "marker": marker("policy")}, {}, record)
            arm = root / "arm_generation"
            attempt(root, config, server.uri, calls, "generation worker killed",
                    {"at": "generation.generate", "armed_by": str(arm), "do": "kill", "marker": marker("generation")},
                    {1: arm.touch}, record)
            facts["damaged"] = damage_newest(checkpoints)
            filled: dict = {}
            disk_full = (lambda: filled.setdefault("filler", str(fill_disk(checkpoints)))) if tmpfs == "mounted" else (
                lambda: None)
            attempt(root, config, server.uri, calls, "damaged newest, disk full", None, {2: disk_full}, record)
            if filled:
                Path(filled["filler"]).unlink()
            driver_in_its_own_process(root, spec_path, server.uri, record)
            arm_stop, outage = root / "arm_stop", {}

            def server_down_and_arm_stop():
                server.stop()
                outage["down_at"] = time.time()
                arm_stop.touch()

            def server_up():
                server.start()
                outage["up_at"] = time.time()

            attempt(root, config, server.uri, calls, "mlflow outage, SIGUSR1 during a save",
                    {"at": "policy.save_checkpoint", "rank": 0, "armed_by": str(arm_stop), "do": "stop_driver",
                     "marker": marker("stop")}, {1: server_down_and_arm_stop, 2: server_up}, record)
            facts["outage"] = outage
    finally:
        server.stop()
        (root / "attempts.json").write_text(json.dumps({"attempts": record, **facts}, indent=1))
        if tmpfs == "mounted":
            # The record of what the run left stays readable after the mount goes: copy it out first.
            shutil.copytree(checkpoints, root / "checkpoints_left", symlinks=True)
            subprocess.run(["umount", str(checkpoints)], check=False)


if __name__ == "__main__":
    spec_file = Path(sys.argv[1])
    if len(sys.argv) > 2 and sys.argv[2] == "--kill-driver":
        kill_driver_attempt(json.loads(spec_file.read_text()), sys.argv[3])
    else:
        rehearse(json.loads(spec_file.read_text()), spec_file)
