"""NeMo-RL v0.7.0's async GRPO (`async_grpo_train`, `AsyncTrajectoryCollector`, `ReplayBuffer`) simulated on
the live engines of live_engine.py, with the training side's time from step_time.py: generation on GPUs of
its own, the collector's age-bounded targets, the trainer waiting for a step's groups, weight updates with
or without in-flight updates, and the per-token age of what is trained. A planning model, not a
measurement; details: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

import heapq
import math
import random
from collections import defaultdict
from dataclasses import dataclass

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import value
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.simulation.generation import RolloutShape, engine_limit
from bapo_nemo.plan.simulation.live_engine import LiveEngine, LiveRequest
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.plan.simulation.step_time import TrainCost

# The weight update of non-colocated generation (NeMo-RL's `broadcast_weights_for_collective`): training
# rank 0 broadcasts every parameter in bf16 to the vLLM workers over NCCL. A pipelined broadcast runs at
# about its slowest link: the source node's NIC, one 400 Gb/s InfiniBand NDR port per GPU on a DGX H100
# (50 GB/s), taken at 80%.
INTER_NODE_BYTES_PER_S = 50e9
NETWORK_EFFICIENCY = 0.8
# What replay_buffer.pt keeps per token of a finished trajectory: the token id (int64) and its generation
# log-prob (fp32) in the pickled message logs.
REPLAY_BYTES_PER_TOKEN = 12


def transfer_seconds(model: ModelShape) -> float:
    return model.num_parameters() * 2.0 / (INTER_NODE_BYTES_PER_S * NETWORK_EFFICIENCY)


@dataclass(frozen=True)
class AsyncSetting:
    max_age: int = 1  # grpo.async_grpo.max_trajectory_age_steps
    in_flight: bool = False  # grpo.async_grpo.in_flight_weight_updates
    recompute_kv: bool = False  # grpo.async_grpo.recompute_kv_cache_after_weight_updates

    @classmethod
    def of_config(cls, config: dict) -> AsyncSetting | None:
        """The config's own `grpo.async_grpo` setting; None when it runs the synchronous loop."""
        if not bool(value(config, "grpo.async_grpo.enabled")):
            return None
        block = get(config, "grpo.async_grpo") or {}
        return cls(
            max(1, int(block.get("max_trajectory_age_steps", 1) or 1)),
            bool(block.get("in_flight_weight_updates", False)),
            bool(block.get("recompute_kv_cache_after_weight_updates", False)),
        )

    @property
    def label(self) -> str:
        if not self.in_flight:
            return f"async, age {self.max_age}"
        return f"async + in-flight{' (KV recomputed)' if self.recompute_kv else ''}, age {self.max_age}"


@dataclass
class AsyncStats:
    """Means per training step over the measured steps."""

    step_s: float
    tokens: float  # response tokens trained per step
    train_s: float  # log-prob passes + training
    train_idle_s: float  # the training GPUs waiting: for a full batch, for the drain and the transfer
    generation_idle_s: float  # each generation GPU with nothing to run or stalled by a transfer
    transfer_s: float
    staleness_mean: float  # policy versions per trained token
    staleness_max: float
    stale_token_share: float  # tokens from an older policy than the one trained
    response_staleness_mean: float  # the same per trajectory, as NeMo-RL records it (its first version)
    mixed_response_share: float  # responses whose tokens come from more than one policy version
    buffer_groups: float  # finished groups in the replay buffer when a checkpoint is saved
    buffer_tokens: float  # their tokens (prompt + response)
    in_flight_groups: float  # groups still generating then: lost on a requeue
    in_flight_tokens: float  # the tokens they had generated
    fill_s: float  # from a cold start (empty buffer and engines) to the first training step

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def tokens_per_hour(self) -> float:
        return 3600.0 * self.tokens_per_s


class _Group:
    __slots__ = ("done_tokens", "left", "responses", "target", "version")

    def __init__(self, target: int, version: int, responses: list[LiveRequest]):
        self.target, self.version, self.responses = target, version, responses
        self.left = len(responses)
        self.done_tokens = 0  # tokens of its responses that already ended


class _AsyncLoop:
    """The event loop: engine events (the earliest first) interleaved with the trainer's."""

    def __init__(self, shape: RolloutShape, lengths: LengthModel, setting: AsyncSetting, train: TrainCost,
                 transfer_s: float, seed: int):
        self.shape, self.setting, self.train, self.transfer_s = shape, setting, train, transfer_s
        self.rng = random.Random(seed)
        self.limit = engine_limit(shape, lengths)
        self.engines = [LiveEngine(shape.engine) for _ in range(shape.engines)]
        self.heap: list[tuple[float, int, int]] = []  # (next event, engine, stamp)
        self.stamps = [0] * len(self.engines)
        self.now = 0.0
        self.version = 0
        self.next_target, self.spawned, self.in_flight = 0, 0, 0
        self.paused = False
        self.buffer: dict[int, list[_Group]] = defaultdict(list)
        self.round_robin = 0
        self.keys = 0
        self.finished: list[LiveRequest] = []  # ended while an engine caught up; handled in time order
        self.groups: dict[int, _Group] = {}  # by response key
        # the trainer
        self.step = 0
        self.free_at = 0.0  # the trainer is free from then (None while it trains or updates weights)
        self.busy = False
        self.train_end: float | None = None
        self.resume_at: float | None = None
        self.draining = False
        self.records: list[dict] = []
        self._spawn()  # the collector starts with the loop, on an empty buffer

    # ---- engines ---------------------------------------------------------------------------------------
    def _schedule(self, e: int) -> None:
        self.stamps[e] += 1
        t = self.engines[e].next_event()
        if t < math.inf:
            heapq.heappush(self.heap, (max(t, self.now), e, self.stamps[e]))

    def _peek(self) -> float:
        while self.heap and self.heap[0][2] != self.stamps[self.heap[0][1]]:
            heapq.heappop(self.heap)
        return self.heap[0][0] if self.heap else math.inf

    def _catch_up(self, e: int, t: float) -> None:
        self.finished += self.engines[e].advance(t)

    def catch_up_all(self, t: float) -> None:
        for e in range(len(self.engines)):
            self._catch_up(e, t)
            self._schedule(e)

    # ---- the collector ---------------------------------------------------------------------------------
    def _spawn(self) -> None:
        P, A, G = self.shape.prompts_per_step, self.setting.max_age, self.shape.group_size
        cap = self.shape.response_cap
        touched = set()
        while not self.paused and self.in_flight < P * A and self.next_target <= self.version + A:
            responses = []
            for _ in range(G):
                length = min(self.limit.draw(self.rng), cap)
                request = LiveRequest(self.keys, self.keys, self.shape.prompt_tokens, length)
                self.keys += 1
                responses.append(request)
                e = self.round_robin % len(self.engines)
                self.round_robin += 1
                if e not in touched:
                    self._catch_up(e, self.now)
                    touched.add(e)
                self.engines[e].submit(request)
            group = _Group(self.next_target, self.version, responses)
            for r in responses:
                self.groups[r.key] = group
            self.in_flight += 1
            self.spawned += 1
            if self.spawned == P:
                self.next_target, self.spawned = self.next_target + 1, 0
        for e in touched:
            self._schedule(e)

    def _response_ended(self, request: LiveRequest) -> None:
        group = self.groups.pop(request.key)
        group.left -= 1
        group.done_tokens += request.done
        if group.left:
            return
        self.in_flight -= 1
        self.buffer[group.target].append(group)
        if self.draining and self.in_flight == 0:
            self.draining = False
            self._update_weights()
        self._spawn()
        self._try_train()

    # ---- the trainer -----------------------------------------------------------------------------------
    def _try_train(self) -> None:
        P = self.shape.prompts_per_step
        if self.busy or len(self.buffer[self.step]) < P:
            return
        groups = self.buffer[self.step][:P]
        self.buffer[self.step] = self.buffer[self.step][P:]
        sequences = [self.shape.prompt_tokens + r.done for g in groups for r in g.responses]
        seconds = self.train.seconds(sequences)
        self.records.append({"groups": groups, "start": self.now, "wait": self.now - self.free_at, "train": seconds})
        self.busy = True
        self.train_end = self.now + seconds

    def _training_ended(self) -> None:
        self.train_end = None
        self.paused = True  # prepare_for_refit: no new starts
        if self.setting.in_flight or self.in_flight == 0:
            self._update_weights()
        else:
            self.draining = True  # the update waits for every group in flight

    def _update_weights(self) -> None:
        self.catch_up_all(self.now)
        self.version += 1
        for e, engine in enumerate(self.engines):
            engine.update_weights(self.transfer_s, self.version, self.setting.recompute_kv)
            self._schedule(e)
        self.resume_at = self.now + self.transfer_s

    def _resumed(self) -> None:
        self.resume_at = None
        self.records[-1]["resumed"] = self.now
        self.records[-1]["checkpoint"] = self._checkpoint_state()
        self.step += 1
        self.busy = False
        self.free_at = self.now
        self.paused = False
        self._spawn()
        self._try_train()

    def _checkpoint_state(self) -> tuple[int, int, int, int]:
        """(finished groups in the buffer, their tokens, groups in flight, their tokens so far) when the
        trainer saves after an update."""
        prompt = self.shape.prompt_tokens
        kept = [g for groups in self.buffer.values() for g in groups]
        kept_tokens = sum(len(g.responses) * prompt + g.done_tokens for g in kept)
        flight = {id(g): g for g in self.groups.values()}
        flight_tokens = sum(g.done_tokens for g in flight.values()) + sum(e.tokens_so_far() for e in self.engines)
        return len(kept), kept_tokens, len(flight), flight_tokens

    # ---- the loop --------------------------------------------------------------------------------------
    def run(self, steps: int) -> None:
        """Until `steps` training steps have ended (their weight updates included)."""
        while self.step < steps:
            if self.finished:
                self.finished.sort(key=lambda r: r.end_time)
                request = self.finished.pop(0)
                self.now = max(self.now, request.end_time)
                self._response_ended(request)
                continue
            trainer = min(t for t in (self.train_end, self.resume_at, math.inf) if t is not None)
            engine_t = self._peek()
            if trainer == math.inf and engine_t == math.inf:
                raise RuntimeError("async simulation stalled: nothing runs and the trainer waits")  # a model bug
            if trainer <= engine_t:
                self.now = max(self.now, trainer)
                if self.train_end is not None and trainer == self.train_end:
                    self._training_ended()
                else:
                    self._resumed()
                continue
            _, e, _ = heapq.heappop(self.heap)
            self.now = max(self.now, engine_t)
            self._catch_up(e, self.now)
            self._schedule(e)

    def engine_idle(self) -> float:
        """Seconds the engines (summed) had nothing to run or were stalled by a weight transfer."""
        return sum(e.idle_s + e.stall_s for e in self.engines)


def simulate_async(
    shape: RolloutShape,
    lengths: LengthModel,
    setting: AsyncSetting,
    train: TrainCost,
    transfer_s: float,
    steps: int = 4,
    warmup: int | None = None,
    seed: int = 0,
) -> AsyncStats:
    """The steady state of NeMo-RL's async GRPO on `shape`'s engines (module docstring)."""
    warmup = setting.max_age + 2 if warmup is None else warmup
    loop = _AsyncLoop(shape, lengths, setting, train, transfer_s, seed)
    # The window runs from the end of step warmup - 1's weight update to the end of the last measured
    # step's: whole periods of the pipeline.
    loop.run(warmup)
    begin = loop.now
    loop.catch_up_all(begin)
    idle0 = loop.engine_idle()
    loop.run(warmup + steps)
    loop.catch_up_all(loop.now)
    idle1 = loop.engine_idle()
    window = loop.now - begin
    measured = loop.records[warmup : warmup + steps]
    ages: dict[int, int] = defaultdict(int)
    response_age, responses, mixed = 0, 0, 0
    for s, record in enumerate(measured, start=warmup):
        for g in record["groups"]:
            for r in g.responses:
                for version, n in r.versions:
                    ages[s - version] += n
                response_age += s - g.version
                responses += 1
                mixed += len(r.versions) > 1
    total = sum(ages.values()) or 1
    checkpoints = [r["checkpoint"] for r in measured]
    # the training GPUs wait for a full batch, then (after training) for the drain and the transfer
    train_idle = sum(r["wait"] + r["resumed"] - r["start"] - r["train"] for r in measured)
    return AsyncStats(
        step_s=window / steps,
        tokens=sum(r.done for rec in measured for g in rec["groups"] for r in g.responses) / steps,
        train_s=sum(r["train"] for r in measured) / steps,
        train_idle_s=train_idle / steps,
        generation_idle_s=(idle1 - idle0) / len(loop.engines) / steps,
        transfer_s=transfer_s,
        staleness_mean=sum(age * n for age, n in ages.items()) / total,
        staleness_max=float(max((age for age, n in ages.items() if n), default=0)),
        stale_token_share=sum(n for age, n in ages.items() if age > 0) / total,
        response_staleness_mean=response_age / max(1, responses),
        mixed_response_share=mixed / max(1, responses),
        buffer_groups=sum(c[0] for c in checkpoints) / steps,
        buffer_tokens=sum(c[1] for c in checkpoints) / steps,
        in_flight_groups=sum(c[2] for c in checkpoints) / steps,
        in_flight_tokens=sum(c[3] for c in checkpoints) / steps,
        fill_s=loop.records[0]["start"],
    )
