"""The refit's hand-over between the CPU Megatron policy workers and the generation workers, where NeMo-RL
moves the weights by CUDA IPC over ZMQ (colocated) or an NCCL broadcast (not colocated): a named Ray actor.
The policy's rank 0 posts the full weights after every optimizer step it is asked to refit; every
generation worker takes the newest, waiting when the policy has not posted them yet (the two sides are
called at once, as upstream's stream and update are).

Takers: tests/support/nemo_vllm_standins.py's imitation of vLLM, and the real engine's worker extension
(tests/support/vllm_cpu_worker.py), which ends the refit in vLLM's own `model.load_weights`.
"""

from __future__ import annotations

import asyncio

import ray
import torch
from safetensors.torch import load, save

MAILBOX = "bapo_rehearsal_refit_mailbox"
RAY_TIMEOUT_S = 300


@ray.remote(num_cpus=0)
class RefitMailbox:
    """Holds the newest weights the policy posted; `take` waits for weights newer than the caller's.

    The weights travel as safetensors bytes, as vLLM's refit moves raw buffers:
    a tensor pickled in a process that imported megatron-core (the policy workers) names megatron-core's
    storage loader, so unpickling it would import megatron-core into the mailbox and every generation
    worker (~5 CPU-s each, per run)."""

    def __init__(self):
        self.version, self.weights, self.policy_steps = 0, None, None
        self.posted = asyncio.Condition()

    async def post(self, weights: bytes, policy_steps: int) -> int:
        async with self.posted:
            self.version += 1
            self.weights, self.policy_steps = weights, policy_steps
            self.posted.notify_all()
        return self.version

    async def take(self, newer_than: int) -> tuple[int, bytes, int]:
        async with self.posted:
            await self.posted.wait_for(lambda: self.version > newer_than)
            return self.version, self.weights, self.policy_steps


_MAILBOX: list = []


def refit_mailbox():
    """The run's mailbox. Created by the first worker that asks and kept alive by the handle each worker
    holds (a named actor goes away with its last reference): it ends with the run's workers, so a resumed
    run gets a new one."""
    if not _MAILBOX:
        _MAILBOX.append(RefitMailbox.options(name=MAILBOX, get_if_exists=True).remote())
    return _MAILBOX[0]


def take_newer(version: int) -> tuple[int, dict[str, torch.Tensor], int]:
    """The newest weights posted after `version` (waiting for them): (their version, the weights, the
    policy's optimizer steps they have seen)."""
    taken, data, steps = ray.get(refit_mailbox().take.remote(version), timeout=RAY_TIMEOUT_S)
    return taken, load(data), steps


def post(weights: dict[str, torch.Tensor], policy_steps: int) -> int:
    """Hand the policy's full weights (and the optimizer steps they have seen) to every taker."""
    return ray.get(refit_mailbox().post.remote(save(weights), policy_steps), timeout=RAY_TIMEOUT_S)
