"""Run a study's grid on the embedded trainer: `python -m experiments.run STUDY [STUDY ...|all] [--quick] [--jobs 2]`.

- one process per run (`experiments.worker`), `--jobs` at a time, each with one torch thread;
- one supervised warm-up per seed, shared by every run of that seed (copied into each run directory,
  where the trainer finds its warm-up cache);
- resumable: a run with a DONE marker for the same settings is skipped, an interrupted one resumes from
  its newest checkpoint, and a directory left by *different* settings is moved aside, never deleted;
- every run logs to the study's MLflow store `<root>/<mode>/<study>/mlflow.db` (experiment
  `<study>-<mode>`, run name = cell, seed and settings fingerprint);
- Ctrl-C / SIGTERM: running trainers get SIGTERM (they checkpoint and exit); rerun to continue;
- `--commit REV`: the runs execute a clean export of that commit (`git archive`, in `<root>/_code/<sha>`)
  instead of the working tree, so uncommitted edits in a shared checkout cannot leak into a study.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from experiments.grid import (
    BASE_CONFIG,
    BUDGETS,
    STUDIES,
    Budget,
    RunSpec,
    expand,
    fingerprint,
    get_study,
    warmup_overrides,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = REPO / "experiments" / "runs"
DONE = "DONE"
SPEC = "spec.json"


# ---- where things live -------------------------------------------------------------------------------------
def study_dir(root: Path, mode: str, study: str) -> Path:
    return root / mode / study


def run_dir(root: Path, spec: RunSpec) -> Path:
    return study_dir(root, spec.mode, spec.study) / spec.run_name


def warmup_dir(root: Path, mode: str, seed: int, budget: Budget | None = None) -> Path:
    """Shared by the modes: the warm-up depends on the seed and its overrides only (hashed into the name)."""
    overrides = warmup_overrides(seed, mode, budget)
    return root / "_warmup" / f"seed_{seed}__{fingerprint(dict(o.split('=', 1) for o in overrides))}"


def tracking_uri(root: Path, mode: str, study: str) -> str:
    return f"sqlite:///{(study_dir(root, mode, study) / 'mlflow.db').resolve()}"


def experiment_name(study: str, mode: str) -> str:
    return f"{study}-{mode}"


def tracking_overrides(root: Path, spec: RunSpec) -> list[str]:
    return [
        f"logger.mlflow.tracking_uri={tracking_uri(root, spec.mode, spec.study)}",
        f"logger.mlflow.experiment_name={experiment_name(spec.study, spec.mode)}",
        f"logger.mlflow.run_name={spec.run_name}",
    ]


# ---- skip / resume / move aside ----------------------------------------------------------------------------
def run_status(path: Path, fingerprint: str) -> str:
    """done: finished with these settings. resume: started with these settings. conflict: the directory
    holds a run with other settings. new: nothing there."""
    if not path.exists():
        return "new"
    spec_file = path / SPEC
    recorded = json.loads(spec_file.read_text()).get("fingerprint") if spec_file.is_file() else None
    if recorded != fingerprint:
        return "conflict"
    done = path / DONE
    if done.is_file() and json.loads(done.read_text()).get("fingerprint") == fingerprint:
        return "done"
    return "resume"


def move_aside(path: Path) -> Path:
    """Keep a conflicting directory under a new name (nothing is deleted, nor renamed over: a name already
    taken, e.g. by a move in the same second, gets a counter)."""
    base = path.with_name(f"{path.name}.superseded-{time.strftime('%Y%m%dT%H%M%S')}")
    target, n = base, 1
    while target.exists():
        target, n = base.with_name(f"{base.name}.{n}"), n + 1
    path.rename(target)
    return target


def warmup_ready(path: Path) -> bool:
    return (path / "warmup" / "info.json").is_file() and (path / DONE).is_file()


# ---- MLflow store: created once by the runner, so parallel runs never race to create it -------------------
def ensure_store(root: Path, mode: str, study: str) -> None:
    from mlflow.tracking import MlflowClient  # slow import: only when runs are about to start

    from bapo_nemo.tracking.store import store_lock

    sdir = study_dir(root, mode, study)
    sdir.mkdir(parents=True, exist_ok=True)
    with store_lock(tracking_uri(root, mode, study)):  # the lock the trainers take: two runners may share it
        client = MlflowClient(tracking_uri=tracking_uri(root, mode, study))
        name = experiment_name(study, mode)
        if client.get_experiment_by_name(name) is None:
            client.create_experiment(name, artifact_location=(sdir / "mlartifacts" / name).resolve().as_uri())


# ---- one process per run -----------------------------------------------------------------------------------
@dataclass
class Job:
    label: str
    output_dir: Path
    overrides: list[str]
    fingerprint: str
    warmup_from: Path | None = None


def export_commit(root: Path, rev: str) -> tuple[Path, str]:
    """A clean copy of the repository at `rev` (made once per commit); returns (directory, full sha)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    target = root / "_code" / sha
    if not (target / ".exported").is_file():
        partial = target.with_name(sha + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", sha], cwd=REPO, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(partial)], input=archive.stdout, check=True)
        (partial / ".exported").write_text(sha + "\n")
        partial.rename(target)
    return target, sha


class Launcher:
    """Starts worker processes and stops them all on request (SIGTERM: they checkpoint and exit).

    `code_dir`/`commit`: run the workers from that copy of the repository (see `export_commit`)."""

    def __init__(self, code_dir: Path = REPO, commit: str | None = None) -> None:
        self.code_dir, self.commit = code_dir, commit
        self.stopping = threading.Event()
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()

    def run(self, job: Job) -> tuple[int, float]:
        if self.stopping.is_set():
            return -1, 0.0
        job.output_dir.mkdir(parents=True, exist_ok=True)
        config = self.code_dir / BASE_CONFIG.relative_to(REPO)
        spec = {
            "config": str(config),
            "overrides": job.overrides,
            "output_dir": str(job.output_dir.resolve()),
            "warmup_from": str(job.warmup_from.resolve()) if job.warmup_from else None,
            "fingerprint": job.fingerprint,
        }
        (job.output_dir / SPEC).write_text(json.dumps(spec, indent=2))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(self.code_dir), os.environ.get("PYTHONPATH")])),
        }
        if self.commit:
            env["BAPO_GIT_COMMIT"] = (
                self.commit
            )  # the export has no .git: tag the MLflow runs with the commit
        start = time.time()
        with (job.output_dir / "train.log").open("a") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} start {job.label}\n")
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "experiments.worker", str(job.output_dir / SPEC)],
                cwd=self.code_dir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            with self._lock:
                self._procs[proc.pid] = proc
            rc = proc.wait()
            with self._lock:
                self._procs.pop(proc.pid, None)
        seconds = time.time() - start
        if rc == 0:
            (job.output_dir / DONE).write_text(
                json.dumps(
                    {
                        "fingerprint": job.fingerprint,
                        "seconds": round(seconds, 1),
                        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    }
                )
            )
        return rc, seconds

    def stop_all(self) -> None:
        self.stopping.set()
        with self._lock:
            for proc in self._procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)


def plan(
    studies: list[str], mode: str, root: Path, budget: Budget | None = None
) -> tuple[list[RunSpec], dict]:
    """All runs of `studies` and their status (done / resume / conflict / new)."""
    specs = list({(s.study, s.run_name): s for name in studies for s in expand(name, mode, budget)}.values())
    # Seed-major over all studies: if a study is cut short, every cell still has its first seeds.
    specs.sort(key=lambda s: s.seed)
    return specs, {s.run_name: run_status(run_dir(root, s), s.fingerprint) for s in specs}


def run_studies(
    studies: list[str],
    mode: str = "full",
    jobs: int = 2,
    root: Path = DEFAULT_ROOT,
    budget: Budget | None = None,
    progress: bool = True,
    commit: str | None = None,
) -> dict[str, int]:
    """Run every run not yet done; returns counts {done, skipped, failed, stopped}. `commit`: run the
    trainer from a clean export of that git revision instead of the working tree."""
    root = Path(root)
    specs, status = plan(studies, mode, root, budget)
    for spec in specs:
        if status[spec.run_name] == "conflict":
            moved = move_aside(run_dir(root, spec))
            print(f"moved {run_dir(root, spec)} (other settings) aside to {moved.name}", file=sys.stderr)
            status[spec.run_name] = "new"
    todo = [s for s in specs if status[s.run_name] != "done"]
    counts = {"done": 0, "skipped": len(specs) - len(todo), "failed": 0, "stopped": 0}
    if not todo:
        print(f"all {len(specs)} runs of {', '.join(studies)} ({mode}) are already done", file=sys.stderr)
        return counts
    for name in dict.fromkeys(s.study for s in todo):
        ensure_store(root, mode, name)

    started = time.time()
    if commit:
        code_dir, sha = export_commit(root, commit)
        print(f"running the code of commit {sha[:10]} from {code_dir}", file=sys.stderr)
        launcher = Launcher(code_dir, sha)
    else:
        launcher = Launcher()

    def on_signal(signum, _frame) -> None:
        print(
            f"\n{signal.Signals(signum).name} received: stopping the running trainers (they checkpoint); rerun "
            "the same command to continue",
            file=sys.stderr,
            flush=True,
        )
        launcher.stop_all()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    bar = tqdm(
        total=len(specs),
        initial=counts["skipped"],
        desc=f"{'+'.join(studies)} ({mode})",
        unit="run",
        disable=not progress,
        dynamic_ncols=True,
    )
    running: set[str] = set()
    failures: list[str] = []
    lock = threading.Lock()

    def show() -> None:
        bar.set_postfix_str(
            f"running: {', '.join(sorted(running))[:120]}"
            + (f" | failed {len(failures)}" if failures else "")
        )

    def execute(job: Job, counts_as_run: bool) -> int:
        with lock:
            running.add(job.label)
            show()
        rc, _ = launcher.run(job)
        with lock:
            running.discard(job.label)
            if rc == 0:
                counts["done"] += counts_as_run
            elif launcher.stopping.is_set():
                counts["stopped"] += counts_as_run
            else:
                counts["failed"] += counts_as_run
                failures.append(job.label)
                bar.write(f"FAILED ({rc}): {job.label}; log: {job.output_dir / 'train.log'}")
            if counts_as_run:
                bar.update(1)
            show()
        return rc

    # Warm-ups are queued first: a run's task only ever waits for a warm-up that has already started,
    # so the pool cannot deadlock.
    # One warm-up per (seed, budget): a study with its own budget (e.g. other demonstrations) has its own.
    warmups = {warmup_dir(root, mode, s.seed, s.budget): (s.seed, s.budget) for s in todo}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        warm: dict[Path, Future] = {}
        for wdir, (seed, wbudget) in sorted(warmups.items(), key=lambda kv: kv[1][0]):
            if warmup_ready(wdir):
                warm[wdir] = _done_future(0)
            else:
                warm[wdir] = pool.submit(
                    execute,
                    Job(f"warm-up seed {seed}", wdir, warmup_overrides(seed, mode, wbudget), f"warmup-{seed}"),
                    False,
                )

        def run_one(spec: RunSpec) -> int:
            if warm[warmup_dir(root, mode, spec.seed, spec.budget)].result() != 0:
                with lock:
                    counts["failed" if not launcher.stopping.is_set() else "stopped"] += 1
                    bar.update(1)
                return -1
            job = Job(
                spec.run_name,
                run_dir(root, spec),
                spec.override_list() + tracking_overrides(root, spec),
                spec.fingerprint,
                warmup_from=warmup_dir(root, mode, spec.seed, spec.budget),
            )
            return execute(job, True)

        futures = [pool.submit(run_one, spec) for spec in todo]
        for f in futures:
            f.result()
    bar.close()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    print(
        f"{counts['done']} runs completed, {counts['skipped']} already done, {counts['failed']} failed, "
        f"{counts['stopped']} stopped in {(time.time() - started) / 60:.1f} min"
        + (f"; failed: {', '.join(failures)}" if failures else ""),
        file=sys.stderr,
    )
    return counts


def _done_future(value: int) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "studies", nargs="+", metavar="STUDY", help=f"one or more of: {', '.join(STUDIES)}, or all"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the quick variant: {BUDGETS['quick'].max_steps} RL steps instead of "
        f"{BUDGETS['full'].max_steps}, seeds {list(BUDGETS['quick'].seeds)} instead of "
        f"{list(BUDGETS['full'].seeds)}, fewer grid points (see docs/results.md)",
    )
    parser.add_argument(
        "--jobs", type=int, default=2, help="runs in parallel, one torch thread each (default 2)"
    )
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="where runs and MLflow stores go")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their status, run nothing")
    parser.add_argument(
        "--commit",
        metavar="REV",
        default=None,
        help="run the trainer from a clean export of this git revision (e.g. HEAD), not the "
        "working tree: uncommitted edits in a shared checkout then cannot change a study",
    )
    args = parser.parse_args(argv)
    names = list(STUDIES) if args.studies == ["all"] else args.studies
    try:
        for name in names:
            get_study(name)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    mode = "quick" if args.quick else "full"
    if args.dry_run:
        specs, status = plan(names, mode, args.root)
        for spec in specs:
            print(
                f"{status[spec.run_name]:9s} {spec.study:12s} {spec.run_name}  {' '.join(spec.override_list())}"
            )
        print(f"{len(specs)} runs", file=sys.stderr)
        return 0
    counts = run_studies(names, mode, args.jobs, args.root, commit=args.commit)
    if counts["stopped"]:
        return 130
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
