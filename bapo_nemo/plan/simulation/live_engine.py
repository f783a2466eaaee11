"""One vLLM engine fed over time, as NeMo-RL's async GRPO drives it (`async_engine: true`): `submit` queues a
request while others run, `advance(until)` moves the clock, `update_weights` stalls the engine for the
transfer and switches the policy version (KV cache kept, or prefilled again with `recompute`), and each
request records the runs of tokens each version produced. The time model is engine_sim.py's; only the
feeding differs (docs/architecture.md, "The planner's models").
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from bapo_nemo.plan.simulation.engine_sim import Engine, GenerationModelError, PrefixCache


@dataclass(eq=False)
class LiveRequest:
    key: Hashable  # the response (prefix-cache identity)
    group: int  # the prompt group it belongs to
    context: int  # prompt tokens
    new_tokens: int  # tokens it generates before EOS, max_tokens or max_model_len
    done: int = 0  # tokens generated before its current admission
    versions: list[list[int]] = field(default_factory=list)  # [policy version, tokens] per run of one version
    end_time: float | None = None

    def add_tokens(self, version: int, tokens: int) -> None:
        if tokens <= 0:
            return
        if self.versions and self.versions[-1][0] == version:
            self.versions[-1][1] += tokens
        else:
            self.versions.append([version, tokens])


@dataclass
class _Running:
    request: LiveRequest
    context: int  # tokens in the KV cache at admission (prompt + tokens done)
    start_step: int  # the engine's decode step at admission
    mark_step: int  # where the current policy version's run of tokens began


class LiveEngine:
    def __init__(self, engine: Engine, version: int = 0):
        self.engine = engine
        self.version = version
        self.t = 0.0
        self.step = 0
        self.kv = 0
        self.waiting: deque[LiveRequest] = deque()
        self.running: dict[int, _Running] = {}
        self._ends: list[tuple[int, int]] = []  # (decode step at which it ends, id)
        self._next_id = 0
        self.cache = PrefixCache()
        # seconds spent decoding, prefilling, stalled by weight transfers, idle (nothing to run)
        self.decode_s = self.prefill_s = self.stall_s = self.idle_s = 0.0
        self.tokens = 0
        self.preemptions = 0
        self._planned: tuple[int, int, int, int, float] | None = None  # (step, kv, live, steps, seconds)

    # ---- what the caller sees ---------------------------------------------------------------------------
    def submit(self, request: LiveRequest) -> None:
        self.waiting.append(request)

    def generated(self, run: _Running) -> int:
        return self.step - run.start_step

    def tokens_so_far(self) -> int:
        """Tokens generated so far by the requests still on this engine (running or queued)."""
        return sum(r.request.done + self.generated(r) for r in self.running.values()) + sum(
            q.done for q in self.waiting
        )

    def next_event(self) -> float:
        """When this engine's next own event happens if nothing is submitted before: now if a request can
        be admitted or must be preempted, else the end of the decode run to the next end of sequence or
        full cache; infinity when it has nothing to do."""
        if self.waiting and self._can_admit(self.waiting[0]):
            return self.t
        if not self.running:
            return math.inf if not self.waiting else self.t
        live, steps = self._next_run()
        if steps == 0:
            return self.t
        seconds = self.engine.run_seconds(live, self.kv, steps)
        self._planned = (self.step, self.kv, live, steps, seconds)  # advance() reuses it if nothing changed
        return self.t + seconds

    def advance(self, until: float) -> list[LiveRequest]:
        """Run the engine's own events up to `until`; returns the requests that ended (with end_time)."""
        finished: list[LiveRequest] = []
        while True:
            self._admit()
            if not self.running:
                if self.waiting:
                    q = self.waiting[0]
                    raise GenerationModelError(
                        f"a context of {q.context + q.done} tokens does not fit the engine's KV cache of "
                        f"{self.engine.kv_tokens} tokens: raise policy.generation.vllm_cfg."
                        "gpu_memory_utilization or tensor_parallel_size, or lower policy.max_total_sequence_length"
                    )
                if until > self.t:
                    self.idle_s += until - self.t
                    self.t = until
                return finished
            planned = self._planned
            if planned is not None and planned[0] == self.step and planned[1] == self.kv and planned[2] == len(self.running):
                _, _, live, steps, seconds = planned
            else:
                live, steps = self._next_run()
                if steps == 0:
                    self._preempt_newest()
                    continue
                seconds = self.engine.run_seconds(live, self.kv, steps)
            self._planned = None
            if self.t + seconds > until:
                cut = self._steps_within(live, until - self.t)
                if cut > 0:
                    self._decode(live, cut, self.engine.run_seconds(live, self.kv, cut))
                return finished
            self._decode(live, steps, seconds)
            while self._ends and self._ends[0][0] == self.step:
                _, rid = heapq.heappop(self._ends)
                run = self.running.pop(rid, None)
                if run is None:
                    continue
                request = run.request
                self.kv -= run.context + self.generated(run)
                request.add_tokens(self.version, self.step - run.mark_step)
                request.done += self.generated(run)
                request.end_time = self.t
                self.cache.put(request.key, request.context + request.done)
                finished.append(request)

    def update_weights(self, transfer_s: float, version: int, recompute: bool = False) -> None:
        """A weight update at the engine's clock: it stalls for the transfer; tokens generated afterwards
        belong to `version`. With `recompute` the running requests' contexts are prefilled again."""
        self.t += transfer_s
        self.stall_s += transfer_s
        for run in self.running.values():
            run.request.add_tokens(self.version, self.step - run.mark_step)
            run.mark_step = self.step
        self.version = version
        if recompute:
            self.cache = PrefixCache()
            seconds = sum(self.engine.prefill_seconds(r.context + self.generated(r)) for r in self.running.values())
            self.t += seconds
            self.prefill_s += seconds

    # ---- continuous batching (engine_sim.run_engine's rules) --------------------------------------------
    def _can_admit(self, request: LiveRequest) -> bool:
        return (
            len(self.running) < self.engine.max_num_seqs
            and request.context + request.done + 1 + len(self.running) <= self.engine.kv_tokens - self.kv
        )

    def _admit(self) -> None:
        while self.waiting and self._can_admit(self.waiting[0]):
            request = self.waiting.popleft()
            context = request.context + request.done
            cached = min(self.cache.take(request.key), context)
            self.kv += context
            if self.cache.tokens > self.engine.kv_tokens - self.kv:
                self.cache.fit(self.engine.kv_tokens - self.kv)
            seconds = self.engine.prefill_seconds(context, cached)
            self.t += seconds
            self.prefill_s += seconds
            rid = self._next_id
            self._next_id += 1
            self.running[rid] = _Running(request, context, self.step, self.step)
            heapq.heappush(self._ends, (self.step + request.new_tokens - request.done, rid))

    def _next_run(self) -> tuple[int, int]:
        """(running requests, decode steps to the next end of sequence or full cache; 0: full now)."""
        while self._ends[0][1] not in self.running:
            heapq.heappop(self._ends)
        live = len(self.running)
        room = (self.engine.kv_tokens - self.kv) // live
        return live, min(self._ends[0][0] - self.step, room)

    def _preempt_newest(self) -> None:
        rid = next(reversed(self.running))
        run = self.running.pop(rid)
        request = run.request
        generated = self.generated(run)
        self.kv -= run.context + generated
        request.add_tokens(self.version, self.step - run.mark_step)
        request.done += generated
        self.cache.put(request.key, request.context + request.done)
        self.waiting.appendleft(request)
        self.preemptions += 1

    def _decode(self, live: int, steps: int, seconds: float) -> None:
        self.t += seconds
        self.decode_s += seconds
        self.step += steps
        self.kv += live * steps
        self.tokens += live * steps
        if self.cache.tokens > self.engine.kv_tokens - self.kv:
            self.cache.fit(self.engine.kv_tokens - self.kv)

    def _steps_within(self, live: int, seconds: float) -> int:
        """The most whole decode steps of `live` requests that end within `seconds`."""
        if seconds <= 0:
            return 0
        lo, hi = 0, 1
        while self.engine.run_seconds(live, self.kv, hi) <= seconds:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.engine.run_seconds(live, self.kv, mid) <= seconds:
                lo = mid
            else:
                hi = mid
        return lo
