"""The Slurm launch script on a real Slurm: daemons started here on localhost.

`slurmctld` + `slurmd -N localhost` (Debian `slurm-wlm` 22.05) with `munged` are started by a module
fixture from a slurm.conf generated in a temp dir (the machine's real CPUs and memory, cons_tres,
linuxproc, one partition, requeue allowed), and torn down at the end. Jobs are submitted with the real
`sbatch`, requeued with the real `scontrol requeue`. The script runs in bare-metal mode
(`BAPO_BARE_METAL=1`: no container, no GPU) with the embedded trainer on a tiny CPU config. Nothing is
faked: only pyxis/GPUs are absent, which is what bare-metal mode is for. Skips with the reason when Slurm
or munge cannot be found or started.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.hang_guard import HANG_GUARD_S
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "slurm" / "bapo_32b.sbatch"

pytestmark = [pytest.mark.slurm]


# ---------------------------------------------------------------------------------------------------------
# A real single-node Slurm cluster on localhost
# ---------------------------------------------------------------------------------------------------------


def _which_all(*names: str) -> dict[str, str | None]:
    # Daemons live in /usr/sbin, which is not on every user's PATH.
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return {name: shutil.which(name, path=path) for name in names}


@dataclass
class LocalSlurm:
    """slurmctld + slurmd + munged owned by this process, configured entirely inside `root`."""

    root: Path
    bins: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    # -- set-up ----------------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        user = pwd.getpwuid(os.getuid()).pw_name
        is_root = os.getuid() == 0
        self.root.chmod(0o755)  # the munge user must be able to reach its own directory
        munge_dir = self.root / "munge"
        munge_dir.mkdir()
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        munge_user = None
        if is_root:
            # munged refuses to run as root; Debian's package creates the `munge` user.
            munge_user = pwd.getpwnam("munge")
            for p in (munge_dir, key):
                os.chown(p, munge_user.pw_uid, munge_user.pw_gid)
        munge_dir.chmod(0o700)
        socket_path = munge_dir / "munge.socket"
        self.procs.append(
            subprocess.Popen(
                [
                    self.bins["munged"],
                    "--foreground",
                    "--force",
                    f"--socket={socket_path}",
                    f"--key-file={key}",
                    f"--pid-file={munge_dir / 'munged.pid'}",
                    f"--log-file={munge_dir / 'munged.log'}",
                    f"--seed-file={munge_dir / 'munged.seed'}",
                ],
                user=munge_user.pw_uid if munge_user else None,
                group=munge_user.pw_gid if munge_user else None,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        self._wait_for(lambda: socket_path.exists(), timeout, "munged socket", munge_dir / "munged.log")
        # Slurm clients (and munged's socket) live in a 0700 dir: open it to the job user, who is us.
        if is_root:
            munge_dir.chmod(0o755)

        probe = subprocess.run(
            [self.bins["slurmd"], "-C"], capture_output=True, text=True, timeout=30, check=False
        )
        cpus = re.search(r"CPUs=(\d+)", probe.stdout)
        memory = re.search(r"RealMemory=(\d+)", probe.stdout)
        if not (cpus and memory):
            raise RuntimeError(f"slurmd -C gave no CPUs/RealMemory: {probe.stdout!r} {probe.stderr!r}")
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=bapotest",
                    "SlurmctldHost=localhost(127.0.0.1)",
                    f"SlurmUser={user}",
                    f"SlurmdUser={user}",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={socket_path}",
                    f"StateSaveLocation={self.root / 'state'}",
                    f"SlurmdSpoolDir={self.root / 'spool'}",
                    f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                    f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                    f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    f"PlugStackConfig={self.root / 'plugstack.conf'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "SchedulerType=sched/backfill",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    # Time between SIGTERM and SIGKILL: the trainer finishes its step and checkpoints in it.
                    "KillWait=30",
                    "MinJobAge=600",
                    # A loaded 2-core machine (xdist workers, Ray actors) answers late: Slurm's defaults
                    # (10 s per message, 10 s to start a batch job, 60 s for a killed step to go) would
                    # count a slow answer as a failure and requeue-hold the job or drain the node, after
                    # which no later attempt ever starts. Wider limits change nothing on an idle machine.
                    "MessageTimeout=60",
                    "BatchStartTimeout=120",
                    "UnkillableStepTimeout=300",
                    # Schedule pending jobs within seconds, not the default minute.
                    "SchedulerParameters=sched_interval=2,bf_interval=2",
                    (
                        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus.group(1)} "
                        f"RealMemory={memory.group(1)} State=UNKNOWN"
                    ),
                    "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        # MLFLOW_* left in this process by earlier in-process tests (NeMo-RL's MLflowLogger sets
        # MLFLOW_TRACKING_URI) must not redirect the jobs' trainers; a test that wants one passes it.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        self.env = {**clean, "SLURM_CONF": str(self.conf)}
        self.procs.append(
            subprocess.Popen(
                [self.bins["slurmctld"], "-D", "-c", "-f", str(self.conf)],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        self.procs.append(
            subprocess.Popen(
                [self.bins["slurmd"], "-D", "-N", "localhost", "-f", str(self.conf)],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        self._wait_for(
            self._node_ready, timeout, "node 'localhost' idle", self.root / "log" / "slurmctld.log"
        )

    def _node_ready(self) -> bool:
        for proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        out = self.run(["sinfo", "-h", "-n", "localhost", "-o", "%T"], check=False)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def _wait_for(self, ready, timeout: float, what: str, log: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.5)
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        raise RuntimeError(f"timed out waiting for {what}; log {log}:\n{tail}")

    # -- use -------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], check: bool = True, env: dict | None = None, timeout: float = 60):
        return subprocess.run(
            cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, check=check, timeout=timeout
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def diagnosis(self, job_id: str) -> str:
        """What Slurm says of a job and of the node, and the controller's log tail: for the message of a
        wait that timed out (a job pending for a reason, a drained node)."""
        job = self.run(["scontrol", "show", "job", job_id], check=False)
        node = self.run(["scontrol", "show", "node", "localhost"], check=False)
        log = self.root / "log" / "slurmctld.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        return (f"--- scontrol show job {job_id}\n{job.stdout}{job.stderr}--- scontrol show node localhost\n"
                f"{node.stdout}{node.stderr}--- {log} (tail)\n{tail}")

    def wait_for_state(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s\n{self.diagnosis(job_id)}")

    # -- tear-down -------------------------------------------------------------------------------------
    def stop(self) -> None:
        if self.env:
            self.run(["scancel", "--user", pwd.getpwuid(os.getuid()).pw_name], check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm():
    bins = _which_all("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
    missing = [name for name, path in bins.items() if path is None]
    if missing:
        pytest.skip(
            f"Slurm/munge not installed ({', '.join(missing)} missing): run `bash .ci/system_deps.sh`"
        )
    if os.getuid() == 0:
        try:
            pwd.getpwnam("munge")
        except KeyError:
            pytest.skip(
                "running as root but there is no `munge` user to run munged as (install Debian's munge)"
            )
    cluster = LocalSlurm(Path(tempfile.mkdtemp(prefix="bapo-slurm-")), bins)
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
        pytest.skip(f"could not start Slurm on localhost: {exc}")
    yield cluster
    cluster.stop()
    shutil.rmtree(cluster.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Submitting slurm/bapo_32b.sbatch in bare-metal mode with the embedded trainer
# ---------------------------------------------------------------------------------------------------------

# A tiny embedded run: a 10-step warm-up, checkpoints every 2 steps, almost no evaluation.
TINY_RUN_ARGS = (
    "--no-progress warmup.steps=10 checkpointing.save_period=2 checkpointing.keep_top_k=2 grpo.val_period=1000 "
    "eval.k=1 task.eval_size=4 tracking.samples_every=1000"
)
SECRET = "hf_do_not_print_me_1234567890"


@dataclass
class Submission:
    job_id: str
    run_dir: Path
    log_dir: Path
    out_file: Path
    job_name: str = "bapo-test"

    def attempt_dir(self, n: int) -> Path:
        return self.log_dir / f"{self.job_name}-{self.job_id}" / f"attempt-{n}"

    def latest_step(self) -> int | None:
        latest = self.run_dir / "checkpoints" / "latest"
        if not latest.is_file() or not latest.read_text().strip():
            return None
        return int(latest.read_text().strip().removeprefix("step_"))


def submit(
    slurm: LocalSlurm,
    tmp_path: Path,
    max_steps: int,
    wait: bool = False,
    env: dict[str, str] | None = None,
    sbatch_args: tuple[str, ...] = (),
    script: Path = SBATCH_SCRIPT,
    job_name: str = "bapo-test",
) -> Submission:
    run_dir, log_dir = tmp_path / "run", tmp_path / "logs"
    job_env = {
        "BAPO_BARE_METAL": "1",
        "BAPO_REPO": str(REPO),
        "PYTHON": sys.executable,
        "OUTPUT_DIR": str(run_dir),
        "LOG_ROOT": str(log_dir),
        "MAX_STEPS": str(max_steps),
        "EXTRA_ARGS": TINY_RUN_ARGS,
        "WATCHDOG_SEC": "1",
        "HF_TOKEN": SECRET,
        **(env or {}),
    }
    # --time 15 min with the pre-limit signal 30 s before it: only the test sends USR1.
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--time=15",
        "--signal=B:USR1@30",
        f"--job-name={job_name}",
        f"--output={tmp_path}/%x-%j.out",
        *sbatch_args,
    ]
    if wait:
        cmd.append("--wait")
    out = subprocess.run(
        [*cmd, str(script)],
        env={**slurm.env, **job_env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.stdout.strip(), f"sbatch gave no job id: {out.stderr}"
    job_id = out.stdout.strip().split(";")[0]
    sub = Submission(job_id, run_dir, log_dir, tmp_path / f"{job_name}-{job_id}.out", job_name)
    if wait:
        assert out.returncode == 0, f"sbatch --wait exit {out.returncode}:\n{job_output(sub)}"
    return sub


def job_output(sub: Submission) -> str:
    """The job's stdout and every attempt's driver log, for assertion messages."""
    parts = [sub.out_file.read_text(errors="replace") if sub.out_file.exists() else "(no job output)"]
    for log in sorted(sub.log_dir.glob("*/attempt-*/driver.log")):
        parts.append(f"--- {log}\n{log.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts)


def wait_until(predicate, timeout: float, what: str, sub: Submission | None = None, period: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{job_output(sub) if sub else ''}")


CREDENTIAL_SECOND_MARGIN_S = 2  # see release_requeued
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def held_until(info: dict[str, str]) -> float:
    """A pending job's start time in seconds since the epoch; infinite where Slurm has none yet ("Unknown")."""
    try:
        return time.mktime(time.strptime(info.get("StartTime", ""), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return math.inf


def release_requeued(slurm: LocalSlurm, sub: Submission, restarts: int) -> None:
    """Slurm holds a requeued job for ~2 minutes (BeginTime); start it sooner to keep the test short.

    Not at once: slurmd refuses a job whose credential was created in the same second as its previous
    attempt's credential was revoked (Slurm's cred_revoked compares whole seconds: `ctime <= revoked`), and
    fails it ("Job credential revoked"). The revocation is stamped when the requeue ends the previous
    attempt, before the job shows PENDING here, so a start time two seconds after that is always a later
    second. The hold is (re)set when the previous attempt has finished completing, which can be after the
    job already shows PENDING, so the release is repeated until the next attempt is running."""

    start_at: list[int] = []  # the one start time asked for, in whole seconds since the epoch

    def next_attempt_running() -> bool:
        info = slurm.job(sub.job_id)
        if info.get("Restarts") != str(restarts):
            if info.get("JobState") in ENDED:  # ended without the requeue: no use waiting for it
                raise AssertionError(f"job {sub.job_id} ended {info.get('JobState')} after {info.get('Restarts')} "
                                     f"restarts, not requeued for attempt {restarts}\n{job_output(sub)}")
            return False
        if info.get("JobState") == "RUNNING":
            return True
        if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
            if not start_at:
                start_at.append(math.ceil(time.time()) + CREDENTIAL_SECOND_MARGIN_S)
            # Asked again only while Slurm's hold is later than that time: asking "now + 2 s" each time
            # would push the start back at every look.
            if held_until(info) > start_at[0]:
                when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start_at[0]))
                slurm.run(["scontrol", "update", f"JobId={sub.job_id}", f"StartTime={when}"], check=False)
        return False

    try:
        wait_until(next_attempt_running, HANG_GUARD_S, f"attempt {restarts} of job {sub.job_id} running", sub, period=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{slurm.diagnosis(sub.job_id)}") from None


def driver_summary(sub: Submission, attempt: int) -> dict:
    """The JSON summary `bapo-nemo train` prints last, from one attempt's driver log."""
    text = (sub.attempt_dir(attempt) / "driver.log").read_text()
    start = text.rindex("{\n")
    return json.loads(text[start : text.index("\n}", start) + 2])


def mlflow_runs(run_dir: Path, tracking_uri: str | None = None):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri or f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bapo-embedded")
    assert experiment is not None, "no MLflow experiment 'bapo-embedded' in the run's sqlite store"
    return client, client.search_runs([experiment.experiment_id])


def rl_steps_logged(client, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "perf/step_time_s"))


def all_logs_text(tmp_path: Path) -> str:
    return "\n".join(
        p.read_text(errors="replace")
        for p in tmp_path.rglob("*")
        if p.is_file() and p.suffix in {".out", ".log", ".txt", ".sh"}
    )


@pytest.mark.slow
def test_bare_metal_job_trains_checkpoints_and_logs_to_mlflow(slurm, tmp_path):
    # MLFLOW_TRACKING_URI reaches the trainer (a sqlite store outside the run dir stands for a server).
    tracking_uri = f"sqlite:///{tmp_path / 'central' / 'mlflow.db'}"
    (tmp_path / "central").mkdir()
    sub = submit(slurm, tmp_path, max_steps=4, wait=True, env={"MLFLOW_TRACKING_URI": tracking_uri})

    info = slurm.job(sub.job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info
    # Contract 1: checkpoints every 2 steps -> step_2, step_4; latest names the newest complete one.
    assert sub.latest_step() == 4, job_output(sub)
    step_4 = sub.run_dir / "checkpoints" / "step_4"
    assert (step_4 / "COMPLETE").is_file() and (step_4 / "model" / "config.json").is_file()
    training_info = json.loads((step_4 / "training_info.json").read_text())
    assert training_info["step"] == 4
    assert (sub.run_dir / "hf_final" / "COMPLETE").is_file()

    # The MLflow run the checkpoint names holds RL steps 1..4, once each, and is finished.
    assert not (sub.run_dir / "mlflow.db").exists()
    assert training_info["mlflow_tracking_uri"] == tracking_uri
    client, runs = mlflow_runs(sub.run_dir, tracking_uri)
    assert [r.info.run_id for r in runs] == [training_info["mlflow_run_id"]]
    assert runs[0].info.status == "FINISHED"
    assert rl_steps_logged(client, runs[0].info.run_id) == [1, 2, 3, 4]

    # Per-job log folder; the token was passed through but never written anywhere.
    attempt = sub.attempt_dir(0)
    assert driver_summary(sub, 0)["step"] == 4
    assert "HF_TOKEN=***" in (attempt / "env.txt").read_text()
    assert "HF_TOKEN is set (passed through)" in sub.out_file.read_text()
    assert SECRET not in all_logs_text(tmp_path)
    assert "training finished" in sub.out_file.read_text()


@pytest.mark.slow
def test_time_limit_signal_and_scontrol_requeue_both_resume_the_same_run(slurm, tmp_path):
    """Attempt 0 gets the pre-time-limit signal (`scancel --signal=USR1 --batch` is what
    `#SBATCH --signal=B:USR1@900` sends): the trainer checkpoints, the script requeues the job itself.
    Attempt 1 is requeued from outside with `scontrol requeue`. Attempt 2 runs to the final step."""
    max_steps = 20  # room for both interruptions to land before the end, even on a fast machine
    sub = submit(slurm, tmp_path, max_steps=max_steps)

    # Attempt 0: wait for a first checkpoint (the trainer is then past start-up), then the USR1.
    wait_until(lambda: (sub.latest_step() or 0) >= 2, HANG_GUARD_S, "a first checkpoint in attempt 0", sub)
    slurm.run(["scancel", "--signal=USR1", "--batch", sub.job_id])
    release_requeued(slurm, sub, restarts=1)
    stop_0 = driver_summary(sub, 0)
    assert stop_0["stopped_by_signal"] == "SIGUSR1"
    assert 2 <= stop_0["step"] < max_steps
    assert "requeueing job" in sub.out_file.read_text()

    # Attempt 1: resumed past attempt 0's step; requeue it from outside once it has checkpointed again.
    wait_until(lambda: (sub.latest_step() or 0) > stop_0["step"], HANG_GUARD_S, "a checkpoint in attempt 1", sub)
    slurm.run(["scontrol", "requeue", sub.job_id])
    release_requeued(slurm, sub, restarts=2)
    stop_1 = driver_summary(sub, 1)
    assert stop_1["stopped_by_signal"] == "SIGTERM"
    assert stop_0["step"] < stop_1["step"] < max_steps

    # Attempt 2 finishes.
    info = slurm.wait_for_state(sub.job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=HANG_GUARD_S)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", f"{info}\n{job_output(sub)}"
    final = driver_summary(sub, 2)
    assert final["step"] == max_steps and final["stopped_by_signal"] is None
    assert sub.latest_step() == max_steps and (sub.run_dir / "hf_final" / "COMPLETE").is_file()

    # One MLflow run across the three attempts, every RL step logged exactly once, warm-up done once.
    assert stop_0["mlflow_run_id"] == stop_1["mlflow_run_id"] == final["mlflow_run_id"]
    client, runs = mlflow_runs(sub.run_dir)
    assert [r.info.run_id for r in runs] == [final["mlflow_run_id"]]
    assert runs[0].info.status == "FINISHED"
    assert rl_steps_logged(client, final["mlflow_run_id"]) == list(range(1, max_steps + 1))
    assert len(client.get_metric_history(final["mlflow_run_id"], "warmup/loss")) == 1


def trainer_pid(slurm: LocalSlurm, job_id: str) -> int | None:
    """The embedded trainer's pid among the job's processes (`scontrol listpids`: linuxproc tracks them)."""
    out = slurm.run(["scontrol", "listpids", job_id], check=False).stdout
    for line in out.splitlines()[1:]:
        fields = line.split()
        if not fields or not fields[0].isdigit():
            continue
        try:
            argv = Path(f"/proc/{fields[0]}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0] == sys.executable.encode() and b"bapo_nemo.cli" in argv:
            return int(fields[0])
    return None


def test_a_dead_driver_step_fails_the_job_without_requeue(slurm, tmp_path):
    sub = submit(slurm, tmp_path, max_steps=40)
    pid = wait_until(lambda: trainer_pid(slurm, sub.job_id), HANG_GUARD_S, "the trainer process", sub)
    os.kill(pid, signal.SIGKILL)
    # Failed, not requeued (PENDING): a crash would only crash again. How soon is not asserted (the
    # watchdog looks every WATCHDOG_SEC=1 s, but a loaded machine delays Slurm too): HANG_GUARD_S bounds a hang.
    info = slurm.wait_for_state(sub.job_id, {"COMPLETED", "FAILED", "CANCELLED", "PENDING", "TIMEOUT"}, timeout=HANG_GUARD_S)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", f"{info}\n{job_output(sub)}"
    assert "driver failed with exit code 137" in job_output(sub)


# PYTHON for the job in the test below. It stands in for the NeMo-RL cluster driver's ending when one of its
# Ray workers dies (bapo_nemo/nemo/worker_watch.py: one line naming the worker, exit 75), which needs NeMo-RL's
# GPU workers and cannot run under this Slurm. The first attempt's training is the real trainer's, held at a
# barrier (tests/support/barrier.py) where it first prunes old checkpoints, right after its first checkpoint (step_0,
# the warmed-up model) is complete: the run has a checkpoint and is unfinished by construction. The stand-in
# then ends it as the worker's death would and exits as the driver does. Every other call, the requeued
# attempt's training included, is the real Python.
WORKER_LOST_PYTHON = """#!/bin/sh
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && [ "$1 $2 $3" = "-m bapo_nemo.cli train" ]; then
  shift 2
  "$REAL_PYTHON" "$BAPO_REPO/tests/support/barrier.py" bapo_nemo.embedded.output.checkpoint:_prune "$BARRIER" "$@" &
  trainer=$!
  until ls "$BARRIER"/arrived-* >/dev/null 2>&1; do
    kill -0 "$trainer" 2>/dev/null || { wait "$trainer"; exit $?; }
    sleep 0.2
  done
  kill -KILL "$trainer"
  wait "$trainer" 2>/dev/null
  echo "error: policy worker 1 of 8 on node 3 died during step 1 (a stand-in's line); newest complete checkpoint: $OUTPUT_DIR/checkpoints/step_0. Rerun the same command to resume from it (a requeue does) once the node is back or replaced" >&2
  exit 75
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.slow
def test_a_lost_worker_requeues_the_job_and_it_resumes(slurm, tmp_path):
    """The driver exits 75 when a Ray worker died (its newest checkpoint intact): the script requeues the
    job, which resumes from that checkpoint into the same MLflow run and finishes."""
    python = tmp_path / "python"
    python.write_text(WORKER_LOST_PYTHON)
    python.chmod(0o755)
    (tmp_path / "barrier").mkdir()
    sub = submit(slurm, tmp_path, max_steps=4, env={
        "PYTHON": str(python), "REAL_PYTHON": sys.executable, "BARRIER": str(tmp_path / "barrier")})
    release_requeued(slurm, sub, restarts=1)
    info = slurm.wait_for_state(sub.job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=HANG_GUARD_S)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{job_output(sub)}"
    out = sub.out_file.read_text()
    assert "the driver lost a Ray worker (exit 75; see " in out and "requeueing job" in out, out
    assert "died during step 1" in (sub.attempt_dir(0) / "driver.log").read_text()
    assert f"resuming from step 0 ({sub.run_dir / 'checkpoints' / 'step_0'})" in (sub.attempt_dir(1) / "driver.log").read_text()
    final = driver_summary(sub, 1)
    assert final["step"] == 4 and final["stopped_by_signal"] is None
    client, runs = mlflow_runs(sub.run_dir)
    assert [r.info.run_id for r in runs] == [final["mlflow_run_id"]]
    assert rl_steps_logged(client, final["mlflow_run_id"]) == [1, 2, 3, 4]


def test_bad_inputs_fail_with_a_clear_error(slurm, tmp_path):
    """Each job fails in seconds with a message naming the input and the fix (no training starts)."""
    seven_b = REPO / "slurm" / "bapo_7b.sbatch"
    cases = {
        "config": (
            SBATCH_SCRIPT,
            {"CONFIG": "configs/does_not_exist.yaml"},
            f"training config (CONFIG) not found: {REPO}/configs/does_not_exist.yaml",
        ),
        "python": (
            SBATCH_SCRIPT,
            {"PYTHON": "/nonexistent/python3"},
            "PYTHON=/nonexistent/python3 not found",
        ),
        "container": (SBATCH_SCRIPT, {"BAPO_BARE_METAL": "0"}, "no pyxis plugin"),
        "repo": (SBATCH_SCRIPT, {"BAPO_REPO": str(tmp_path)}, f"{tmp_path}/slurm/lib/common.sh not found"),
        # The 7B variant runs the same script (exec) with its preset: same checks, its own job name.
        "7b": (seven_b, {"CONFIG": "configs/nope_7b.yaml"}, f"not found: {REPO}/configs/nope_7b.yaml"),
    }
    subs = {}
    for name, (script, env, _) in cases.items():
        (tmp_path / name).mkdir()
        subs[name] = submit(
            slurm, tmp_path / name, max_steps=1, env=env, script=script, job_name=f"bad-{name}"
        )
    for name, (_, _, message) in cases.items():
        sub = subs[name]
        info = slurm.wait_for_state(sub.job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=HANG_GUARD_S)
        assert info["JobState"] == "FAILED", f"{name}: {info}"
        assert message in sub.out_file.read_text(), f"{name}: {job_output(sub)}"
