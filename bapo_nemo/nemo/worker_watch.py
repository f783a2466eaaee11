"""A lost Ray worker ends the run at once, with one line naming it, the step and the checkpoint to resume.

When one rank of a Megatron worker group dies in `train()`, its peers block in a collective and the
driver in `ray.get` until a timeout (NCCL's default: 30 minutes). `WorkerWatch` keeps one `__ray_ready__`
call pending per worker of `Policy` and `VllmGeneration`, which Ray fails as soon as the process is gone;
it then interrupts the driver's main thread, and `RunFailure` exits with `WORKER_LOST_EXIT` and one line
(exiting frees the other ranks: Ray ends a driver's actors with it).
"""

from __future__ import annotations

import _thread
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

POLL_S = 2.0
# How long the main thread gets to unwind after the interrupt before the watch ends the process itself
# (a main thread inside a C call that never checks for signals).
UNWIND_GRACE_S = 60.0
WORKER_LOST_EXIT = 75  # EX_TEMPFAIL: the run resumes from its checkpoint once the cluster is whole
# How long a worker's failed task waits for Ray to tell whether a peer died: a rank's collective fails as
# soon as a dead peer's socket closes, before Ray has seen that process end.
PEER_DEATH_WAIT_S = 60.0


@dataclass(frozen=True, eq=False)
class Worker:
    """One Ray actor of the run and how a user names it."""

    kind: str  # "policy worker", "generation worker"
    rank: int
    of: int
    node: int | None
    handle: Any

    def name(self) -> str:
        node = f" on node {self.node}" if self.node is not None else ""
        return f"{self.kind} {self.rank} of {self.of}{node}"


def group_workers(kind: str, owner: Any) -> list[Worker]:
    """The workers of `owner.worker_group` (a NeMo-RL Policy or VllmGeneration), by global rank."""
    group = getattr(owner, "worker_group", None)
    if group is None:
        return []
    handles, metadata = list(group.workers), list(group.worker_metadata)
    return [Worker(kind, int(meta.get("global_rank", i)), len(handles), meta.get("node_idx"), handle)
            for i, (handle, meta) in enumerate(zip(handles, metadata))]


class StepCounter:
    """The one count of finished `policy.train` calls (one per GRPO step, sync and async), shared by whoever
    needs it: the step a run is in is the step of the checkpoint it resumed from plus those calls."""

    def __init__(self, resumed_step: int):
        self.resumed = int(resumed_step)
        self.calls = 0  # finished in this process

    def wrap(self, train: Callable) -> Callable:
        def counted_train(*args, **kwargs):
            result = train(*args, **kwargs)
            self.calls += 1
            return result

        return counted_train

    @property
    def done(self) -> int:
        return self.resumed + self.calls

    @property
    def current(self) -> int:
        return self.done + 1


@dataclass
class Death:
    worker: Worker | None
    cause: str
    step: int


class FailureReport:
    """The one line a lost worker ends the run with."""

    def __init__(self, newest_checkpoint: Callable[[], str]):
        self.newest_checkpoint = newest_checkpoint  # read when the line is written

    def line(self, death: Death) -> str:
        who = death.worker.name() if death.worker is not None else "a Ray worker of this run"
        return (f"error: {who} died during step {death.step} ({death.cause}); newest complete checkpoint: "
                f"{self.newest_checkpoint()}. Rerun the same command to resume from it (a requeue does) once "
                "the node is back or replaced")


class WorkerWatch:
    """Polls every worker's liveness on a daemon thread; see the module docstring."""

    def __init__(self, workers: Iterable[Worker], steps: StepCounter, report: FailureReport,
                 poll_s: float = POLL_S, grace_s: float = UNWIND_GRACE_S):
        self.workers, self.steps, self.report = list(workers), steps, report
        self.poll_s, self.grace_s = poll_s, grace_s
        self.death: Death | None = None
        self._retired: set[Worker] = set()  # shut down on purpose: their end is no death
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bapo-worker-watch", daemon=True)

    @classmethod
    def over(cls, owners: dict[str, Any], steps: StepCounter, report: FailureReport, **kwargs: Any) -> Self:
        """A watch over every worker of `owners` (what a user calls them -> a NeMo-RL Policy or
        VllmGeneration); each owner's own shutdown() tells the watch first that its workers end on purpose."""
        groups = {kind: (owner, group_workers(kind, owner)) for kind, owner in owners.items()}
        watch = cls([worker for _owner, group in groups.values() for worker in group], steps, report, **kwargs)
        for owner, group in groups.values():
            if group:
                watch.retire_on_shutdown(owner, group)
        return watch

    def __enter__(self) -> Self:
        if self.workers:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.poll_s + 5)

    def retire_on_shutdown(self, owner: Any, workers: list[Worker]) -> None:
        """`owner.shutdown()` (a Policy or VllmGeneration; v0.7.0's async loop shuts its workers down itself)
        first tells the watch that `workers` end on purpose. The wrap is on the owner's class and the note in
        a module table, never on the instance: async GRPO pickles the VllmGeneration for its collector actor,
        and an attribute holding this watch (its locks) cannot be pickled."""
        _retire_when_shut_down(type(owner))
        _RETIRING[id(owner)] = lambda: self._retired.update(workers)

    def _run(self) -> None:
        import ray

        pending: dict[Any, Worker] = {}
        while not self._stop.is_set():
            watched = set(pending.values())
            for worker in self.workers:
                if worker not in watched and worker not in self._retired:
                    pending[worker.handle.__ray_ready__.remote()] = worker
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                worker = pending.pop(ref)
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a failed liveness call is a lost worker
                    if worker in self._retired:  # shut down by the run itself
                        continue
                    if not self._stop.is_set():  # not the run's own end
                        self._lost(Death(worker, death_cause(exc), self.steps.current))
                    return
            self._stop.wait(self.poll_s)

    def dead_now(self, wait_s: float = PEER_DEATH_WAIT_S) -> Death | None:
        """Asks every worker now: the first Ray reports dead within `wait_s`, else None. A live worker still
        busy answers only when its call ends: it counts as alive once `wait_s` is over."""
        import ray

        asked = {w.handle.__ray_ready__.remote(): w for w in self.workers if w not in self._retired}
        deadline = time.monotonic() + wait_s
        while asked and time.monotonic() < deadline:
            ready, _ = ray.wait(list(asked), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                worker = asked.pop(ref)
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a failed liveness call is a lost worker
                    return Death(worker, death_cause(exc), self.steps.current)
        return None

    def _lost(self, death: Death) -> None:
        self.death = death
        _thread.interrupt_main()  # KeyboardInterrupt where the driver waits; RunFailure says the line
        if self._stop.wait(self.grace_s):
            return
        # The main thread did not unwind: say it here and end (Ray then ends this driver's actors).
        print(self.report.line(death), file=sys.stderr, flush=True)
        os._exit(WORKER_LOST_EXIT)


# id(owner) -> what its shutdown() tells a watch first (see WorkerWatch.retire_on_shutdown)
_RETIRING: dict[int, Callable[[], None]] = {}


def _retire_when_shut_down(cls: type) -> None:
    original = cls.shutdown
    if getattr(original, "_bapo_retires", False):
        return

    def shutdown(self, *args, **kwargs):
        tell = _RETIRING.pop(id(self), None)
        if tell is not None:
            tell()
        return original(self, *args, **kwargs)

    shutdown._bapo_retires = True
    cls.shutdown = shutdown


def death_cause(exc: BaseException) -> str:
    """What Ray says about a dead actor, in a clause: its pid and host, and how its process ended."""
    text = str(exc)
    pid, ip = re.search(r"^\s*pid: (\d+)", text, re.MULTILINE), re.search(r"^\s*ip: (\S+)", text, re.MULTILINE)
    exit_type = re.search(r"Worker exit type: (\S+)(?: Worker exit detail: ([^.]*))?", text)
    where = f"pid {pid.group(1)}" + (f" on {ip.group(1)}" if ip else "") if pid else ""
    if exit_type:
        how = f"its process ended: {exit_type.group(1)}" + (f", {exit_type.group(2)}" if exit_type.group(2) else "")
    else:
        first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
        how = first.rstrip(".")[:200]
    return f"{where}, {how}" if where else how


# A failure the driver can say in one line, with the exit code it ends with; None: not this one.
Explainer = Callable[[BaseException], "tuple[str, int] | None"]


class RunFailure:
    """`with RunFailure(watch, ...)` around the train loop: a lost worker (seen by the watch, or raised by
    Ray in the driver) becomes one line on stderr and `SystemExit(WORKER_LOST_EXIT)`; so does a failure one
    of `explainers` recognises, with its own line and code; any other exception goes on with its traceback."""

    def __init__(self, watch: WorkerWatch, explainers: Iterable[Explainer] = ()):
        self.watch = watch
        self.explainers = list(explainers)

    def death_from(self, exc: BaseException) -> Death | None:
        if self.watch.death is not None:
            return self.watch.death
        from ray.exceptions import RayActorError, RayTaskError

        actor_error = _in_chain(exc, RayActorError)
        if actor_error is not None:
            worker = next((w for w in self.watch.workers if _actor_id(w.handle) == actor_error.actor_id), None)
            return Death(worker, death_cause(actor_error), self.watch.steps.current)
        if _in_chain(exc, RayTaskError) is None:
            return None
        # A worker's call failed: when a peer died, its collective fails first (gloo/NCCL "connection reset
        # by peer"), and the peer's death is the cause to name
        try:
            return self.watch.dead_now()
        except KeyboardInterrupt:  # the watch found it meanwhile
            return self.watch.death

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        death = self.death_from(exc)
        if death is not None:
            print(self.watch.report.line(death), file=sys.stderr, flush=True)
            raise SystemExit(WORKER_LOST_EXIT) from None
        for explain in self.explainers:
            said = explain(exc)
            if said is not None:
                print(said[0], file=sys.stderr, flush=True)
                raise SystemExit(said[1]) from None
        return False


def _in_chain(exc: BaseException | None, cls: type) -> BaseException | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, cls):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _actor_id(handle: Any) -> str | None:
    actor_id = getattr(handle, "_actor_id", None)  # ActorHandle's ActorID; Ray's errors give its hex()
    return actor_id.hex() if actor_id is not None else None


def resumed_step(grpo_state: Any) -> int:
    """The step of the checkpoint setup() restored (0 for a fresh run): the sync loop counts
    `total_steps`, the async loop `current_step`."""
    from bapo_nemo.nemo.installed import save_state_value

    return max(int(save_state_value(grpo_state, "total_steps") or 0),
               int(save_state_value(grpo_state, "current_step") or 0))


def newest_checkpoint_text(checkpointing: Any) -> Callable[[], str]:
    """What a failure line says about the checkpoint a rerun resumes from, read when the line is written."""
    checkpoint_dir = checkpointing.get("checkpoint_dir") if checkpointing.get("enabled") else None

    def text() -> str:
        if checkpoint_dir is None:
            return "none (checkpointing is off: a rerun starts over)"
        from bapo_nemo.nemo.checkpoint_integrity import newest_intact

        newest, _damaged = newest_intact(Path(checkpoint_dir))
        return str(newest) if newest is not None else f"none in {checkpoint_dir} (a rerun starts over)"

    return text
