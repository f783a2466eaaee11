"""One vLLM engine's continuous batching, simulated event by event, and a NeMo-RL generate call over several
engines (contiguous shards; the call lasts as long as its slowest engine): the time model of generation.py.

A planning model from byte and FLOP counts at assumed efficiencies (step_time.py's constants), following
vLLM V1's FCFS scheduler (admission by `max_num_seqs` and KV room, preemption of the newest request, the
prefix cache) and v0.7.0's `VllmGeneration.generate`. Formulas: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from bapo_nemo.plan.rules.gpus import GPUS
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.simulation.step_time import (
    DECODE_MFU,
    GPU_HBM_BYTES_PER_S,
    GPU_PEAK_BF16_FLOPS,
    HBM_EFFICIENCY,
)

# Latency of one small all-reduce within an NVLink node (vLLM's custom all-reduce / NCCL for messages of a
# few MB): ~10 us. The bandwidth is each GPU's NVLink, each way (plan/rules/gpus.py).
ALLREDUCE_LATENCY_S = 10e-6

# vLLM's `max_num_seqs` for the offline `LLM` class on GPUs with >= 70 GiB (every GPU of plan/rules/gpus.py),
# which NeMo-RL's workers use unless policy.generation.vllm_kwargs.max_num_seqs sets it
# (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults).
DEFAULT_MAX_NUM_SEQS = 1024


class GenerationModelError(ValueError):
    """The config asks for something no engine can run; the message names the key and the fix."""


# ---- one engine -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    """One vLLM engine as the simulator sees it. Bytes are per GPU (each GPU reads its own shard in
    parallel); FLOPs are of the whole model, spread over the engine's GPUs."""

    gpus: int
    weight_bytes: float  # per GPU
    kv_bytes_per_token: float  # per GPU
    kv_tokens: int  # the KV cache pool, tokens per engine
    max_num_seqs: int
    hbm_bytes_per_s: float  # per GPU, effective
    flops_per_s: float  # per GPU, effective
    dense_flops_per_token: float  # 2N
    attention_flops_per_key: float  # 4 L q: one new token against one cached key, QK^T and AV
    allreduce_s: float = 0.0  # tensor parallelism: latency of a decode step's all-reduces (2 per layer)
    allreduce_s_per_sequence: float = 0.0  # and their bandwidth time per running request

    def step_seconds(self, live: int, kv: float) -> float:
        """One decode step of `live` requests holding `kv` cached tokens."""
        return self.run_seconds(live, kv, 1)

    def run_seconds(self, live: int, kv: float, steps: int) -> float:
        """`steps` decode steps of `live` requests; the cache holds kv + live * j tokens at step j."""
        if steps <= 0 or live <= 0:
            return 0.0
        rate = self.gpus * self.flops_per_s
        dense = max(self.weight_bytes / self.hbm_bytes_per_s, live * self.dense_flops_per_token / rate)
        per_key = max(self.kv_bytes_per_token / self.hbm_bytes_per_s, self.attention_flops_per_key / rate)
        keys = steps * kv + live * steps * (steps - 1) / 2  # sum over the steps of the cached tokens
        communication = self.allreduce_s + self.allreduce_s_per_sequence * live
        return steps * (dense + communication) + per_key * keys

    def prefill_seconds(self, tokens: int, cached: int = 0) -> float:
        """Prefill tokens [cached, tokens) of a context; token p attends to p earlier keys."""
        new = tokens - cached
        if new <= 0:
            return 0.0
        attention = self.attention_flops_per_key * (tokens * tokens - cached * cached) / 2
        return (new * self.dense_flops_per_token + attention) / (self.gpus * self.flops_per_s)


def engine_for(
    model: ModelShape,
    gpu: str,
    capacity_bytes: float,
    engine_gpus: int,
    weight_bytes_per_param: float,
    kv_bytes_per_element: float,
    gpu_memory_utilization: float,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
) -> Engine:
    """The KV pool is what vLLM's share of each GPU (`gpu_memory_utilization` x capacity) leaves after
    the weight shard. With more GPUs than KV heads each GPU keeps one head (vLLM replicates them)."""
    g = engine_gpus
    weights = model.num_parameters() * weight_bytes_per_param / g
    kv_heads_per_gpu = max(1, model.num_key_value_heads // g)
    kv_per_token = 2 * model.num_layers * kv_heads_per_gpu * model.head_dim * kv_bytes_per_element
    pool = gpu_memory_utilization * capacity_bytes - weights
    all_reduces = 2 * model.num_layers if g > 1 else 0
    ring_bytes = 2 * (g - 1) / g * model.hidden_size * 2  # bf16 hidden state of one request
    return Engine(
        gpus=g,
        weight_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        kv_tokens=max(0, int(pool // kv_per_token)),
        max_num_seqs=max_num_seqs,
        hbm_bytes_per_s=GPU_HBM_BYTES_PER_S[gpu] * HBM_EFFICIENCY,
        flops_per_s=GPU_PEAK_BF16_FLOPS[gpu] * DECODE_MFU,
        dense_flops_per_token=2.0 * model.num_parameters(),
        attention_flops_per_key=4.0 * model.num_layers * model.q_dim,
        allreduce_s=all_reduces * ALLREDUCE_LATENCY_S,
        allreduce_s_per_sequence=all_reduces * ring_bytes / GPUS[gpu].nvlink_bytes_per_s,
    )


class PrefixCache:
    """vLLM's prefix cache on one engine, per response: blocks of requests that left stay cached in the
    free part of the KV pool, least recently used evicted first (a response's tail blocks before its head,
    as vLLM frees them in reverse)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[Hashable, int] = OrderedDict()
        self.tokens = 0

    def take(self, key: Hashable) -> int:
        """Cached tokens of this response's context (0 if evicted); the blocks go back to a request."""
        cached = self.entries.pop(key, 0)
        self.tokens -= cached
        return cached

    def put(self, key: Hashable, tokens: int) -> None:
        self.tokens += tokens - self.entries.pop(key, 0)
        self.entries[key] = tokens

    def fit(self, room: int) -> None:
        """Evict until the cache fits in `room` free tokens."""
        while self.tokens > room and self.entries:
            key, tokens = next(iter(self.entries.items()))
            drop = min(tokens, self.tokens - max(room, 0))
            self.tokens -= drop
            if drop == tokens:
                del self.entries[key]
            else:
                self.entries[key] = tokens - drop


@dataclass(frozen=True)
class Request:
    key: Hashable  # the response it continues (prefix-cache identity)
    context: int  # tokens before this call: prompt + earlier segments
    new_tokens: int  # tokens this call generates before EOS, max_tokens or max_model_len


@dataclass
class CallStats:
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    tokens: int = 0  # generated
    prefill_tokens: int = 0  # context tokens prefilled (recomputed ones included)
    cached_tokens: int = 0  # context tokens found in the prefix cache
    preemptions: int = 0
    # occupancy: (start s, end s, running requests, KV tokens held, "decode" | "prefill")
    trace: list[tuple[float, float, int, int, str]] = field(default_factory=list)

    def add(self, other: CallStats) -> None:
        """Sum of the counts (the caller keeps the time it wants: engines run in parallel)."""
        self.prefill_seconds += other.prefill_seconds
        self.tokens += other.tokens
        self.prefill_tokens += other.prefill_tokens
        self.cached_tokens += other.cached_tokens
        self.preemptions += other.preemptions


def run_engine(
    engine: Engine, requests: Sequence[Request], cache: PrefixCache | None = None, trace: bool = False
) -> CallStats:
    """One `LLM.generate` call on one engine, event by event (see the module docstring)."""
    stats = CallStats()
    cache = cache if cache is not None else PrefixCache()
    waiting: deque[tuple[Request, int]] = deque((r, 0) for r in requests)  # (request, tokens done)
    running: dict[int, tuple[Request, int, int, int]] = {}  # id -> (request, context at admission, step, done)
    ends: list[tuple[int, int]] = []  # (decode step at which it ends, id)
    step, kv, t, next_id = 0, 0, 0.0, 0

    def record(dt: float, phase: str) -> None:
        nonlocal t
        if trace and dt > 0:
            stats.trace.append((t, t + dt, len(running), kv, phase))
        t += dt

    while waiting or running:
        while waiting and len(running) < engine.max_num_seqs:
            request, done = waiting[0]
            context = request.context + done
            # room for its context and one new token each for it and every running request (vLLM
            # schedules the running requests' next tokens first): a request just preempted for want
            # of those tokens is not readmitted at once
            if context + 1 + len(running) > engine.kv_tokens - kv:
                break
            waiting.popleft()
            cached = min(cache.take(request.key), context)
            kv += context
            cache.fit(engine.kv_tokens - kv)
            seconds = engine.prefill_seconds(context, cached)
            stats.prefill_seconds += seconds
            stats.prefill_tokens += context - cached
            stats.cached_tokens += cached
            running[next_id] = (request, context, step, done)
            heapq.heappush(ends, (step + request.new_tokens - done, next_id))
            next_id += 1
            record(seconds, "prefill")
        if not running:
            raise _does_not_fit(waiting[0][0].context + waiting[0][1], engine)
        while ends[0][1] not in running:  # ended or preempted earlier
            heapq.heappop(ends)
        live = len(running)
        room = (engine.kv_tokens - kv) // live  # steps before the cache is full
        if room == 0:  # preempt the newest request; it is recomputed from the queue's front
            kv -= _preempt_newest(running, waiting, cache, step)
            stats.preemptions += 1
            continue
        steps = min(ends[0][0] - step, room)
        record(engine.run_seconds(live, kv, steps), "decode")
        step += steps
        kv += live * steps
        stats.tokens += live * steps
        cache.fit(engine.kv_tokens - kv)
        kv -= _finish_ended(ends, running, cache, step)
    stats.seconds = t
    return stats


def _does_not_fit(context: int, engine: Engine) -> GenerationModelError:
    return GenerationModelError(
        f"a context of {context} tokens does not fit the engine's KV "
        f"cache of {engine.kv_tokens} tokens: raise policy.generation.vllm_cfg.gpu_memory_utilization "
        "or tensor_parallel_size, or lower policy.max_total_sequence_length"
    )


def _preempt_newest(running: dict, waiting: deque, cache: PrefixCache, step: int) -> int:
    """Moves the newest running request back to the queue's front; the KV tokens it frees."""
    rid = next(reversed(running))
    request, context, start, done = running.pop(rid)
    generated = step - start
    cache.put(request.key, request.context + done + generated)
    waiting.appendleft((request, done + generated))
    return context + generated


def _finish_ended(ends: list, running: dict, cache: PrefixCache, step: int) -> int:
    """Retires the requests that end at `step` (skipping ids preempted earlier); the KV tokens they free."""
    freed = 0
    while ends and ends[0][0] == step:
        _, rid = heapq.heappop(ends)
        if rid not in running:
            continue
        request, context, start, _ = running.pop(rid)
        freed += context + step - start
        cache.put(request.key, request.context + request.new_tokens)
    return freed


def run_call(
    engines: int,
    engine: Engine,
    requests: Sequence[Request],
    caches: list[PrefixCache] | None = None,
    trace: bool = False,
) -> tuple[float, CallStats, list[CallStats]]:
    """One `VllmGeneration.generate` call: contiguous shards of ceil(n / engines) rows, one per engine;
    the call lasts as long as its slowest engine. Returns (seconds, summed counts, per-engine stats)."""
    size = -(-len(requests) // engines) if requests else 0
    per_engine = []
    for e in range(engines):
        cache = caches[e] if caches is not None else None
        per_engine.append(run_engine(engine, requests[e * size : (e + 1) * size], cache, trace))
    total = CallStats()
    for s in per_engine:
        total.add(s)
    total.seconds = max((s.seconds for s in per_engine), default=0.0)
    return total.seconds, total, per_engine


