"""The worker watch (bapo_nemo/nemo/worker_watch.py) on a real local Ray: a worker process killed while the
driver waits on a live, busy worker ends the wait at once with one line naming the dead one; so does Ray's
own error when the dead worker's result comes first. The workers are plain Ray actors standing in for
NeMo-RL's (what the watch reads of them is their handle and rank)."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from bapo_nemo.nemo.worker_watch import (
    WORKER_LOST_EXIT,
    FailureReport,
    RunFailure,
    StepCounter,
    Worker,
    WorkerWatch,
    death_cause,
)

BUSY_S = 600  # the live worker's call: far longer than any test may wait


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@ray.remote
class Rank:
    def pid(self) -> int:
        return os.getpid()

    def work(self, seconds: float) -> int:
        time.sleep(seconds)
        return 1

    def fail(self, message: str) -> None:
        raise RuntimeError(message)


def two_ranks_one_dead():
    """Two workers; the second's process SIGKILLed (a lost GPU or node) before the driver waits."""
    live, dead = Rank.remote(), Rank.remote()
    pid = ray.get(dead.pid.remote())
    workers = [Worker("policy worker", 0, 2, 0, live), Worker("policy worker", 1, 2, 0, dead)]
    os.kill(pid, signal.SIGKILL)
    return workers, live, dead, pid


def wait_for(workers, refs, poll_s: float, capsys) -> tuple[int, float, str]:
    steps, report = StepCounter(resumed_step=3), FailureReport(lambda: "/ckpt/step_3")
    started = time.monotonic()
    with (
        pytest.raises(SystemExit) as ended,
        WorkerWatch(workers, steps, report, poll_s=poll_s) as watch,
        RunFailure(watch),
    ):
        ray.get(refs)
    return ended.value.code, time.monotonic() - started, capsys.readouterr().err.strip()


def test_a_dead_rank_behind_a_busy_one_is_seen_by_the_watch(local_ray, capsys):
    """The driver waits on rank 0's result (busy for 10 minutes); rank 1 is dead. Only the watch can end
    this wait: its liveness call to rank 1 fails, it interrupts the wait, and the run ends with one line."""
    workers, live, dead, pid = two_ranks_one_dead()
    code, waited, err = wait_for(workers, [live.work.remote(BUSY_S), dead.work.remote(1)], poll_s=0.5, capsys=capsys)
    assert code == WORKER_LOST_EXIT
    assert waited < BUSY_S / 2  # a hang guard: the busy call would have held it for BUSY_S
    (line,) = err.splitlines()
    assert line.startswith(f"error: policy worker 1 of 2 on node 0 died during step 4 (pid {pid} on ")
    assert line.endswith("newest complete checkpoint: /ckpt/step_3. Rerun the same command to resume from it "
                         "(a requeue does) once the node is back or replaced")


def test_rays_own_error_for_the_dead_rank_names_it_by_its_actor_id(local_ray, capsys):
    """The dead rank's result first: Ray raises ActorDiedError in the wait before the watch polls again
    (its poll interval is longer than the test): the line still names the rank, matched by actor id."""
    workers, live, dead, pid = two_ranks_one_dead()
    code, _, err = wait_for(workers, [dead.work.remote(1), live.work.remote(1)], poll_s=BUSY_S, capsys=capsys)
    assert code == WORKER_LOST_EXIT
    (line,) = err.splitlines()
    assert line.startswith(f"error: policy worker 1 of 2 on node 0 died during step 4 (pid {pid} on ")


def test_a_peers_failed_call_names_the_rank_that_died(local_ray, capsys):
    """A rank's collective fails as soon as a dead peer's socket closes, and that error can reach the driver
    before Ray or the watch have seen the peer's process end: the line names the dead rank, not the error.
    The watch is never started here, so only RunFailure's own check of the workers can find it."""
    workers, live, _dead, pid = two_ranks_one_dead()
    watch = WorkerWatch(workers, StepCounter(resumed_step=3), FailureReport(lambda: "/ckpt/step_3"))
    with pytest.raises(SystemExit) as ended, RunFailure(watch):
        ray.get(live.fail.remote("gloo/transport/tcp/pair.cc:538] Read error: Connection reset by peer"))
    assert ended.value.code == WORKER_LOST_EXIT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: policy worker 1 of 2 on node 0 died during step 4 (pid {pid} on ")


def test_a_failed_call_with_every_worker_alive_keeps_its_traceback(local_ray):
    rank = Rank.remote()
    watch = WorkerWatch([Worker("policy worker", 0, 1, 0, rank)], StepCounter(0), FailureReport(lambda: "none"))
    with pytest.raises(RuntimeError, match="a bug in the worker"), RunFailure(watch):
        ray.get(rank.fail.remote("a bug in the worker"))


def test_other_failures_keep_their_traceback_and_an_explainer_gives_its_own_line(local_ray, capsys):
    workers = [Worker("policy worker", 0, 1, 0, Rank.remote())]
    steps, report = StepCounter(0), FailureReport(lambda: "none")
    with (
        pytest.raises(ValueError, match="a bug"),
        WorkerWatch(workers, steps, report) as watch,
        RunFailure(watch),
    ):
        raise ValueError("a bug")
    disk_full = lambda exc: ("error: the disk is full", 74) if isinstance(exc, OSError) else None
    with (
        pytest.raises(SystemExit) as ended,
        WorkerWatch(workers, steps, report) as watch,
        RunFailure(watch, [disk_full]),
    ):
        raise OSError(28, "No space left on device")
    assert ended.value.code == 74 and capsys.readouterr().err.strip() == "error: the disk is full"


def test_the_step_counts_finished_trains_from_the_resumed_step():
    steps = StepCounter(resumed_step=5)
    train = steps.wrap(lambda: "trained")
    assert steps.current == 6
    assert train() == "trained" and steps.current == 7


def test_death_cause_reads_rays_message():
    message = ("The actor died unexpectedly before finishing this task.\n\tclass_name: Rank\n\tpid: 4242\n\tip: 10.0.0.7\n"
               "The actor is dead because its worker process has died. Worker exit type: NODE_DIED Worker exit detail: "
               "the node was lost. Some common causes include: ...")
    assert death_cause(RuntimeError(message)) == "pid 4242 on 10.0.0.7, its process ended: NODE_DIED, the node was lost"
    assert death_cause(RuntimeError("The actor is dead.")) == "The actor is dead"


class WorkerGroup:
    """What the watch reads of NeMo-RL's RayWorkerGroup: its public `workers` and `worker_metadata`."""

    def __init__(self, handles):
        self.workers = list(handles)
        self.worker_metadata = [{"global_rank": rank, "node_idx": 0} for rank in range(len(handles))]


class Owner:
    """What the watch wraps: a NeMo-RL Policy's or VllmGeneration's `worker_group` and its shutdown(), which
    ends its workers."""

    def __init__(self, *handles):
        self.worker_group = WorkerGroup(handles)

    def shutdown(self):
        for handle in self.worker_group.workers:
            ray.kill(handle)
        return True


def test_workers_the_run_shuts_down_itself_are_no_death(local_ray):
    """v0.7.0's async loop shuts its generation and policy workers down before it returns: through the
    owner's shutdown, which the watch wraps, their end is not reported while it goes on watching the rest."""

    kept, ended = Rank.remote(), Rank.remote()
    policy, generation = Owner(kept), Owner(ended)
    pickle.dumps(generation)  # async GRPO pickles the VllmGeneration: the watch leaves nothing on it
    steps, report = StepCounter(0), FailureReport(lambda: "none")
    watch = WorkerWatch.over({"policy worker": policy, "generation worker": generation}, steps, report, poll_s=0.2)
    assert [w.name() for w in watch.workers] == ["policy worker 0 of 1 on node 0", "generation worker 0 of 1 on node 0"]
    with watch:
        assert "shutdown" not in vars(generation)
        pickle.dumps(generation)
        assert generation.shutdown() is True
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until Ray knows it is gone
            try:
                ray.get(ended.pid.remote(), timeout=1)
            except Exception:  # noqa: BLE001 - any error: the actor is gone
                break
        time.sleep(1.0)  # five polls after Ray knows
        assert watch.death is None
        assert ray.get(kept.pid.remote()) > 0
