"""Faults injected into the CPU stand-ins at points a run reaches by construction (tests/nemo_rl/test_fault_rehearsal.py).

The fault rehearsal sets FAULT_ENV (JSON) in the driver's environment, which NeMo-RL hands to every worker
it starts. A stand-in method calls `reached(point, rank)` where the fault belongs:

    {"at": "policy.train" | "generation.generate" | "policy.save_checkpoint",
     "rank": 1 | null,             # the worker's rank (policy: its torch.distributed rank); null: any
     "call": 2 | null,             # fire at this call of the point in this worker process ...
     "armed_by": "/path" | null,   # ... or at the first call once this file exists (the driver makes it)
     "do": "kill" | "stop_driver", # SIGKILL this worker; or SIGUSR1 to the driver (DRIVER_PID_ENV)
     "marker": "/path"}            # created exclusively when the fault fires: it fires once, in one worker

What each fault replaces on a cluster: `kill` is a node or GPU lost under that worker (the process ends
with no chance to clean up); `stop_driver` is Slurm's pre-timeout SIGUSR1 reaching the driver while the
workers write a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path

FAULT_ENV = "BAPO_REHEARSAL_FAULT"
DRIVER_PID_ENV = "BAPO_REHEARSAL_DRIVER_PID"
# Which attempt of the fault rehearsal a worker serves (1, 2, ...): the generation workers tag their records.
ATTEMPT_ENV = "BAPO_REHEARSAL_ATTEMPT"
# Where the rehearsals' policy and generation workers record what they did (the test process reads it back).
RECORD_DIR_ENV = "BAPO_REHEARSAL_RECORD_DIR"

_calls: Counter = Counter()


def reached(point: str, rank: int | None = None) -> None:
    """Fire the planned fault if this is its point, rank and call (or it is armed)."""
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return
    plan = json.loads(raw)
    if plan["at"] != point or plan.get("rank") not in (None, rank):
        return
    _calls[point] += 1
    if plan.get("call") is not None and _calls[point] != plan["call"]:
        return
    if plan.get("armed_by") is not None and not Path(plan["armed_by"]).exists():
        return
    try:  # exclusive: one worker fires, once
        fd = os.open(plan["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as marker:
        marker.write(json.dumps({"at": point, "rank": rank, "pid": os.getpid(), "call": _calls[point]}))
        marker.flush()
        os.fsync(marker.fileno())
    if plan["do"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif plan["do"] == "stop_driver":
        os.kill(int(os.environ[DRIVER_PID_ENV]), signal.SIGUSR1)
    else:
        raise ValueError(f"{FAULT_ENV}: unknown action {plan['do']!r}")


class FaultInTheMiddle:
    """A loss that reaches `policy.train` at its first call: after the forward pass of a micro-batch,
    before its backward and the gradient all-reduce (the peers then wait for this rank in a collective)."""

    def __init__(self, loss_fn, rank: int):
        self.loss_fn, self.rank, self.called = loss_fn, rank, False

    def __getattr__(self, name):
        return getattr(self.loss_fn, name)

    def __call__(self, *args, **kwargs):
        if not self.called:
            self.called = True
            reached("policy.train", self.rank)
        return self.loss_fn(*args, **kwargs)
