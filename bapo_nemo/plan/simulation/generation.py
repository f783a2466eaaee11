"""Generation time of a NeMo-RL v0.7.0 GRPO step, with and without partial rollouts, on the engines of
engine_sim.py.

Without partial rollouts: one generate call over the step's P x G prompts, as long as the slowest engine.
With them: the hook's pool simulated on lengths (`PartialRolloutPool`), one budgeted call per step with the
rows dealt by context length and resumed responses prefilled again, until the pool's age structure is
steady. Validation is generated to completion. Details: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from bapo_nemo.plan.simulation.engine_sim import (
    CallStats,
    Engine,
    GenerationModelError,
    PrefixCache,
    Request,
    run_call,
)
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.rollout.balance import balanced_order
from bapo_nemo.rollout.config import PartialRolloutConfig


# ---- the partial-rollout pool, on lengths only ----------------------------------------------------------
class _Response:
    __slots__ = ("done", "finished", "length", "segments", "truncated", "versions")

    def __init__(self, length: int):
        self.length = length  # where the response ends (EOS), or the engine's max_model_len
        self.done = 0
        self.segments = 0
        self.versions: list[tuple[int, int]] = []  # (policy version, tokens) per segment
        self.finished = False
        self.truncated = False


class _Group:
    __slots__ = ("cap", "order", "responses", "room")

    def __init__(self, order: int, responses: list[_Response], cap: int, room: int):
        self.order, self.responses, self.cap, self.room = order, responses, cap, room


class PartialRolloutPool:
    """`PartialRolloutManager`'s scheduling on response lengths: admission (`max_in_flight_groups`,
    `prompts_per_iteration`), the schedule (unfinished responses of the oldest groups first, cut by
    `global_token_budget`), the per-response allowance (budget, response cap), the finish reasons and the
    hand-out of the oldest complete groups. tests/unit/test_plan_generation.py runs both side by side."""

    def __init__(self, config: PartialRolloutConfig, response_cap: int):
        self.config = config
        self.response_cap = response_cap  # max_response_tokens, else generation.max_new_tokens (the hook's)
        self.pending: list[_Group] = []
        self.active: list[_Group] = []
        self.completed: list[_Group] = []
        self._order = 0

    def add(self, lengths_per_group: Sequence[Sequence[int]], cap: int | None = None) -> None:
        """Queue prompt groups; `cap` is the prompt's own cap, what max_total_sequence_length leaves after
        it (also where vLLM stops it: max_model_len). A length above it means no EOS before then."""
        for lengths in lengths_per_group:
            caps = [c for c in (self.response_cap, self.config.max_response_tokens, cap) if c is not None]
            room = cap if cap is not None else 2**62
            self.pending.append(_Group(self._order, [_Response(n) for n in lengths], min(caps), room))
            self._order += 1

    def schedule(self) -> list[tuple[_Group, _Response]]:
        cfg = self.config
        free = len(self.pending)
        if cfg.max_in_flight_groups is not None:
            free = min(free, cfg.max_in_flight_groups - len(self.active) - len(self.completed))
        if cfg.prompts_per_iteration is not None:
            free = min(free, cfg.prompts_per_iteration)
        for _ in range(max(free, 0)):
            self.active.append(self.pending.pop(0))
        todo = [(g, r) for g in self.active for r in g.responses if not r.finished]
        if cfg.global_token_budget is not None:
            todo = todo[: cfg.global_token_budget // cfg.token_budget]
        return todo

    def allowance(self, group: _Group, response: _Response) -> int:
        return min(self.config.token_budget, group.cap - response.done)

    def engine_tokens(self, group: _Group, response: _Response) -> int:
        """What the engine generates for this response in one call (max_tokens = token_budget): up to its
        EOS or max_model_len, more than its allowance when the cap is closer (the hook drops the rest)."""
        return min(self.config.token_budget, response.length - response.done, group.room - response.done)

    def apply(self, scheduled: list[tuple[_Group, _Response]], version: int) -> int:
        """Append one segment to every scheduled response; returns the tokens kept."""
        kept = 0
        for group, r in scheduled:
            n = min(self.engine_tokens(group, r), self.allowance(group, r))
            ended = r.done + n == r.length  # its EOS is among the tokens kept
            r.done += n
            r.segments += 1
            r.versions.append((version, n))
            kept += n
            if ended:
                r.finished = True
            elif r.done >= group.cap or r.segments >= self.config.max_segments:
                r.finished = r.truncated = True
        still = []
        for g in self.active:
            (self.completed if all(r.finished for r in g.responses) else still).append(g)
        self.active = still
        self.completed.sort(key=lambda g: g.order)
        return kept

    def hand_out(self, max_groups: int) -> list[_Group]:
        taken, self.completed = self.completed[:max_groups], self.completed[max_groups:]
        return taken

    @property
    def num_completed(self) -> int:
        return len(self.completed)

    def in_flight(self) -> tuple[int, int]:
        """(unfinished responses, their tokens so far): what the driver holds and checkpoints."""
        rs = [r for g in self.active for r in g.responses if not r.finished]
        return len(rs), sum(r.done for r in rs)


# ---- a GRPO step's rollouts -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutShape:
    """What one GRPO step generates, read from a config (plan/simulation/generation_check.py builds it)."""

    engines: int
    engine: Engine
    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    max_new_tokens: int  # policy.generation.max_new_tokens (without partial rollouts: vLLM's max_tokens)
    max_model_len: int  # vLLM stops a sequence there
    validation_samples: int = 0
    validation_batch: int = 0  # grpo.val_batch_size: validation runs in calls of this many rows

    @property
    def response_cap(self) -> int:
        return min(self.max_new_tokens, self.max_model_len - self.prompt_tokens)


@dataclass
class StepStats:
    """Means over the simulated steady-state steps (per GRPO step)."""

    generation_s: float
    tokens: float  # response tokens handed out to training
    generated_tokens: float  # generated by the engines (cut-off tails included)
    iterations: float  # generate calls
    prefill_s: float  # summed over engines (an engine's clock spends it prefilling)
    engine_s: float  # summed engine busy time (prefill + decode), for the prefill share
    preemptions: float
    cached_share: float  # of context tokens to prefill, found in the prefix cache
    staleness_mean: float = 0.0  # policy versions, token-weighted, at hand-out
    staleness_max: float = 0.0
    stale_token_share: float = 0.0
    truncated_share: float = 0.0  # responses cut by the cap or the resumption cap
    in_flight_responses: float = 0.0  # after the step's hand-out
    in_flight_tokens: float = 0.0
    occupancy: list[tuple[float, float, int, int, str]] = field(default_factory=list)  # slowest engine

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.generation_s if self.generation_s > 0 else 0.0

    @property
    def prefill_share(self) -> float:
        return self.prefill_s / self.engine_s if self.engine_s > 0 else 0.0


def _draw(lengths: LengthModel, rng: random.Random, n: int) -> list[int]:
    return [lengths.draw(rng) for _ in range(n)]


def engine_limit(shape: RolloutShape, lengths: LengthModel) -> LengthModel:
    """Where each response's EOS falls; one token past max_model_len stands for "none before vLLM stops
    it there" (so an EOS exactly at the limit still ends the response)."""
    return replace(lengths, max_tokens=shape.max_model_len - shape.prompt_tokens + 1)


def simulate_without_partial(
    shape: RolloutShape, lengths: LengthModel, steps: int = 4, seed: int = 0, trace_step: int | None = None
) -> StepStats:
    """grpo_train's rollout: one generate call over P x G fresh prompts, max_tokens = max_new_tokens."""
    rng = random.Random(seed)
    limit = engine_limit(shape, lengths)
    n = shape.prompts_per_step * shape.group_size
    totals = CallStats()
    seconds, engine_s, truncated, occupancy = 0.0, 0.0, 0, []
    for s in range(steps):
        drawn = _draw(limit, rng, n)
        truncated += sum(x > shape.response_cap for x in drawn)  # no EOS within max_tokens / max_model_len
        requests = [Request(i, shape.prompt_tokens, min(x, shape.response_cap)) for i, x in enumerate(drawn)]
        t, stats, per_engine = run_call(shape.engines, shape.engine, requests, trace=s == trace_step)
        seconds += t
        engine_s += sum(e.seconds for e in per_engine)
        totals.add(stats)
        if s == trace_step:
            occupancy = max(per_engine, key=lambda e: e.seconds).trace
    return StepStats(
        generation_s=seconds / steps,
        tokens=totals.tokens / steps,
        generated_tokens=totals.tokens / steps,
        iterations=1.0,
        prefill_s=totals.prefill_seconds / steps,
        engine_s=engine_s / steps,
        preemptions=totals.preemptions / steps,
        cached_share=0.0,
        truncated_share=truncated / (n * steps),
        occupancy=occupancy,
    )


def warmup_steps(config: PartialRolloutConfig, shape: RolloutShape, prefill_batches: int) -> int:
    """Steps before the pool's age structure is steady: the longest response's segments, plus the pool."""
    return min(config.max_segments, math.ceil(shape.response_cap / config.token_budget)) + prefill_batches + 1


def _segment_call(
    pool: PartialRolloutPool,
    shape: RolloutShape,
    caches: list[PrefixCache],
    version: int,
    balance: bool = True,
    trace: bool = False,
) -> tuple[float, CallStats, float, list]:
    """One segment iteration of the hook: every scheduled response gets up to `token_budget` tokens in one
    generate call. Returns (seconds, counts, summed engine seconds, the slowest engine's occupancy)."""
    scheduled = pool.schedule()
    if not scheduled:
        raise GenerationModelError(
            "partial rollouts cannot complete a step's prompt groups: check "
            "partial_rollouts.max_in_flight_groups and global_token_budget"
        )
    requests = [Request(id(r), shape.prompt_tokens + r.done, pool.engine_tokens(g, r)) for g, r in scheduled]
    if balance:  # what the hook does (bapo_nemo.rollout.balance); False: the schedule's order
        requests = [requests[i] for i in balanced_order([q.context for q in requests], shape.engines)]
    seconds, stats, per_engine = run_call(shape.engines, shape.engine, requests, caches, trace)
    pool.apply(scheduled, version)
    occupancy = max(per_engine, key=lambda e: e.seconds).trace if trace else []
    return seconds, stats, sum(e.seconds for e in per_engine), occupancy


def simulate_partial(
    shape: RolloutShape,
    lengths: LengthModel,
    config: PartialRolloutConfig,
    prefill_batches: int = 1,
    steps: int = 6,
    warmup: int | None = None,
    seed: int = 0,
    trace_step: int | None = None,
    balance: bool = True,
) -> StepStats:
    """The hook's steady state (module docstring); `trace_step` counts from the first measured step."""
    rng = random.Random(seed)
    limit = engine_limit(shape, lengths)
    pool = PartialRolloutPool(config, config.max_response_tokens or shape.max_new_tokens)
    room = shape.max_model_len - shape.prompt_tokens
    P, G = shape.prompts_per_step, shape.group_size

    def new_batch() -> None:
        pool.add([_draw(limit, rng, G) for _ in range(P)], cap=room)

    for _ in range(prefill_batches):
        new_batch()
    warmup = warmup_steps(config, shape, prefill_batches) if warmup is None else warmup
    acc = dict.fromkeys(("s", "tok", "gen", "it", "pre", "eng", "preempt", "cached", "ctx", "trunc", "n"), 0.0)
    version_tokens: dict[int, float] = {}
    stale_max, flight_n, flight_tok, occupancy = 0, 0.0, 0.0, []
    for step in range(warmup + steps):
        measured = step >= warmup
        new_batch()
        caches = [PrefixCache() for _ in range(shape.engines)]  # the refit + finish_generation reset
        iterations, seconds, totals, engine_s = 0, 0.0, CallStats(), 0.0
        trace = measured and step - warmup == trace_step
        while iterations == 0 or pool.num_completed < P:  # the hook's _generate_until
            t, stats, busy, rows = _segment_call(pool, shape, caches, step, balance, trace)
            occupancy += [(a + seconds, b + seconds, n, kv, p) for a, b, n, kv, p in rows]
            seconds, engine_s, iterations = seconds + t, engine_s + busy, iterations + 1
            totals.add(stats)
        groups = pool.hand_out(P)
        if not measured:
            continue
        for key, value in (
            ("s", seconds), ("gen", totals.tokens), ("it", iterations), ("pre", totals.prefill_seconds),
            ("eng", engine_s), ("preempt", totals.preemptions), ("cached", totals.cached_tokens),
            ("ctx", totals.cached_tokens + totals.prefill_tokens),
        ):
            acc[key] += value
        for r in (r for g in groups for r in g.responses):
            acc["tok"] += r.done
            acc["trunc"] += r.truncated
            acc["n"] += 1
            for v, n in r.versions:
                version_tokens[step - v] = version_tokens.get(step - v, 0) + n
                stale_max = max(stale_max, step - v) if n else stale_max
        n_flight, tok_flight = pool.in_flight()
        flight_n, flight_tok = flight_n + n_flight, flight_tok + tok_flight
    return _partial_step_stats(acc, version_tokens, stale_max, (flight_n, flight_tok), steps, occupancy)


def _partial_step_stats(
    acc: dict[str, float],
    version_tokens: dict[int, float],
    stale_max: int,
    in_flight: tuple[float, float],
    steps: int,
    occupancy: list,
) -> StepStats:
    """simulate_partial's sums over its measured steps, as per-step means."""
    flight_n, flight_tok = in_flight
    total_tokens = sum(version_tokens.values()) or 1.0
    return StepStats(
        generation_s=acc["s"] / steps,
        tokens=acc["tok"] / steps,
        generated_tokens=acc["gen"] / steps,
        iterations=acc["it"] / steps,
        prefill_s=acc["pre"] / steps,
        engine_s=acc["eng"] / steps,
        preemptions=acc["preempt"] / steps,
        cached_share=acc["cached"] / acc["ctx"] if acc["ctx"] else 0.0,
        staleness_mean=sum(d * n for d, n in version_tokens.items()) / total_tokens,
        staleness_max=float(stale_max),
        stale_token_share=sum(n for d, n in version_tokens.items() if d > 0) / total_tokens,
        truncated_share=acc["trunc"] / max(1.0, acc["n"]),
        in_flight_responses=flight_n / steps,
        in_flight_tokens=flight_tok / steps,
        occupancy=occupancy,
    )


def simulate_validation(
    shape: RolloutShape, lengths: LengthModel, config: PartialRolloutConfig | None = None, seed: int = 1
) -> float:
    """Seconds of one validation: `validation_samples` answers in calls of `validation_batch` rows, each
    generated to completion. With partial rollouts the hook does it in budget-sized segment calls of one
    policy (no resumption cap, the same response cap), the prefix cache living across them."""
    n = shape.validation_samples
    if n <= 0:
        return 0.0
    rng = random.Random(seed)
    limit = engine_limit(shape, lengths)
    batch = shape.validation_batch or n
    seconds = 0.0
    for start in range(0, n, batch):
        drawn = _draw(limit, rng, min(batch, n - start))
        if config is None:
            requests = [Request(i, shape.prompt_tokens, min(x, shape.response_cap)) for i, x in enumerate(drawn)]
            seconds += run_call(shape.engines, shape.engine, requests)[0]
            continue
        cap = config.max_response_tokens or shape.max_new_tokens
        segments = PartialRolloutConfig(
            token_budget=config.token_budget,
            max_resumptions=math.ceil(cap / config.token_budget),
            max_response_tokens=cap,
        )
        pool = PartialRolloutPool(segments, cap)
        pool.add([[x] for x in drawn], cap=shape.max_model_len - shape.prompt_tokens)
        caches = [PrefixCache() for _ in range(shape.engines)]
        while pool.num_completed < len(drawn):
            seconds += _segment_call(pool, shape, caches, version=0)[0]
    return seconds


def response_moments(
    shape: RolloutShape, lengths: LengthModel, draws: int = 20000, seed: int = 0
) -> tuple[float, float]:
    """E[s] and E[s^2] of a trained sequence (prompt + response cut at the response cap), by sampling:
    the work a step hands to training."""
    rng = random.Random(seed)
    limit = engine_limit(shape, lengths)
    seqs = [shape.prompt_tokens + min(limit.draw(rng), shape.response_cap) for _ in range(draws)]
    return sum(seqs) / draws, sum(x * x for x in seqs) / draws


def expected_response_tokens(shape: RolloutShape, lengths: LengthModel) -> float:
    """Mean tokens of one response (cut at the response cap). Step times compare as this over the
    simulated tokens/s, free of the sampling noise of the few simulated steps."""
    return response_moments(shape, lengths)[0] - shape.prompt_tokens
