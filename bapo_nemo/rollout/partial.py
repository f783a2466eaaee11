"""Partial rollouts (Kimi k1.5 section 2.6.2): long responses are generated in segments of at most
`token_budget` tokens per iteration, carried over, and continued by the newer policy.

Every token keeps the policy version and behaviour log-prob that produced it, so the loss can weight it
against the policy that really sampled it; only complete prompt groups leave (GRPO baselines need all of
them); the state is JSON, saved with each checkpoint. Framework-free: the embedded trainer and the
NeMo-RL hook drive it with their own generators.
"""

from __future__ import annotations

import json
import math
import operator
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bapo_nemo.rollout.config import PartialRolloutConfig
from bapo_nemo.rollout.types import GenerateFn, GenerationChunk, PromptItem, Rollout, RolloutGroup

STATE_FORMAT_VERSION = 1
# Settings a saved state depends on: resuming with a different value would break the saved sequences'
# invariants (segment lengths, resumption counts, group sizes).
_STATE_BOUND_FIELDS = ("token_budget", "max_resumptions", "max_response_tokens")

FinishReason = Literal["stop", "max_resumptions", "max_response_tokens"]


class PartialRolloutStateError(ValueError):
    """A saved partial-rollout state cannot be loaded; the message names the field and the fix."""


class GenerationOutputError(ValueError):
    """generate_fn returned something that breaks the contract (count, length, log-probs)."""


# ---- state, as it is kept and checkpointed ------------------------------------------------------------
class _SequenceState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response_token_ids: list[int] = Field(default_factory=list)
    behavior_logprobs: list[float] = Field(default_factory=list)
    # one policy version per segment (every token of a segment comes from one generate call): kept per
    # segment, not per token, since in-flight state can hold millions of tokens; expanded at hand-out
    segment_versions: list[int] = Field(default_factory=list)
    segment_lengths: list[int] = Field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class _GroupState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    order: int  # admission order: ties in scheduling and hand-out are broken oldest first
    prompt_id: str
    prompt_token_ids: list[int]
    meta: dict
    max_response_tokens: int | None = None  # the prompt's own cap (PromptItem.max_response_tokens)
    admitted_version: int | None = None
    sequences: list[_SequenceState] = Field(default_factory=list)

    @property
    def complete(self) -> bool:
        return bool(self.sequences) and all(s.done for s in self.sequences)


class _ReturnedSummary(BaseModel):
    """Token-version counts of the groups handed out at the latest policy version (every hand-out of one
    training step, e.g. `take_completed` then `run_iteration`), for `stats(current_version)`."""

    model_config = ConfigDict(extra="forbid")

    policy_version: int | None = None
    version_token_counts: dict[int, int] = Field(default_factory=dict)
    num_groups: int = 0
    num_rollouts: int = 0
    num_truncated: int = 0
    loss_weight_sum: float = 0.0


class _ManagerState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int
    group_size: int
    config: dict
    next_order: int = 0
    last_version: int | None = None
    iterations: int = 0
    pending: list[_GroupState] = Field(default_factory=list)  # queued prompts, not started
    active: list[_GroupState] = Field(default_factory=list)  # started, some response unfinished
    completed: list[_GroupState] = Field(default_factory=list)  # all responses done, not handed out
    last_returned: _ReturnedSummary = Field(default_factory=_ReturnedSummary)
    segments_histogram: dict[int, int] = Field(default_factory=dict)  # over every rollout handed out
    tokens_last_iteration: int = 0
    sequences_last_iteration: int = 0


# ---- the manager --------------------------------------------------------------------------------------
class PartialRolloutManager:
    """Runs partial rollouts for prompt groups of `group_size` samples.

    Typical loop (one call per training iteration, `policy_version` = optimizer updates so far)::

        manager.add_prompts(next_prompts)
        groups = manager.run_iteration(generate_fn, policy_version)   # only complete groups
        ...train on groups...
    """

    def __init__(self, config: PartialRolloutConfig, group_size: int):
        if not isinstance(config, PartialRolloutConfig):
            config = PartialRolloutConfig.parse(config)
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1 (samples per prompt), got {group_size!r}")
        self.config = config
        self.group_size = group_size
        self._state = _ManagerState(
            format_version=STATE_FORMAT_VERSION, group_size=group_size, config=config.model_dump()
        )

    # ---- input -----------------------------------------------------------------------------------------
    def add_prompts(self, prompts: list[PromptItem]) -> None:
        """Queue prompts; they start when a slot is free (`max_in_flight_groups`, `prompts_per_iteration`).
        All prompts are checked first: a bad one queues none of them."""
        checked = []
        for i, prompt in enumerate(prompts):
            where = f"prompts[{i}] (prompt_id={getattr(prompt, 'prompt_id', None)!r})"
            if not isinstance(prompt, PromptItem):
                raise TypeError(f"{where}: expected a PromptItem, got {type(prompt).__name__}")
            try:
                tokens = [operator.index(t) for t in prompt.token_ids]  # ints, numpy/torch integer scalars
            except TypeError:
                tokens = []
            if not tokens:
                raise ValueError(f"{where}: token_ids must be a non-empty list of ints")
            cap = prompt.max_response_tokens
            if cap is not None and (not isinstance(cap, int) or cap < 1):
                raise ValueError(f"{where}: max_response_tokens must be an int >= 1 or None, got {cap!r}")
            try:
                meta = json.loads(json.dumps(prompt.meta))
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"{where}: meta must be JSON-serialisable (it is saved with each checkpoint): {exc}"
                ) from None
            checked.append((str(prompt.prompt_id), tokens, meta, cap))
        for prompt_id, tokens, meta, cap in checked:
            self._state.pending.append(
                _GroupState(
                    order=self._state.next_order,
                    prompt_id=prompt_id,
                    prompt_token_ids=tokens,
                    meta=meta,
                    max_response_tokens=cap,
                )
            )
            self._state.next_order += 1

    # ---- one iteration ---------------------------------------------------------------------------------
    def run_iteration(
        self, generate_fn: GenerateFn, policy_version: int, max_groups: int | None = None
    ) -> list[RolloutGroup]:
        """Admit prompts into free slots, give every scheduled unfinished response one segment of at most
        `token_budget` tokens from `generate_fn` (policy `policy_version`), and hand out the complete
        groups, oldest first (at most `max_groups`; the rest wait for the next call)."""
        self._check_version(policy_version)
        self._admit(policy_version)
        scheduled = self._schedule()
        tokens = self._generate_segments(generate_fn, scheduled, policy_version)
        self._state.iterations += 1
        self._state.tokens_last_iteration = tokens
        self._state.sequences_last_iteration = len(scheduled)
        self._move_completed()
        return self._hand_out(policy_version, max_groups)

    def take_completed(self, policy_version: int, max_groups: int | None = None) -> list[RolloutGroup]:
        """Hand out already-complete groups without generating (e.g. when enough are waiting)."""
        self._check_version(policy_version)
        return self._hand_out(policy_version, max_groups)

    # ---- counts ----------------------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        """Prompts queued but not started."""
        return len(self._state.pending)

    @property
    def num_in_flight(self) -> int:
        """Prompt groups started whose responses are not all finished."""
        return len(self._state.active)

    @property
    def num_completed(self) -> int:
        """Complete groups waiting to be handed out."""
        return len(self._state.completed)

    def stats(self, current_version: int) -> dict[str, float]:
        """Staleness of the groups handed out at the latest policy version (relative to `current_version`),
        in-flight counts and the resumption histogram (segments per rollout, over all rollouts handed out)."""
        s = self._state
        counts = s.last_returned.version_token_counts
        total = sum(counts.values())
        staleness = {current_version - v: n for v, n in counts.items()}
        stale = sum(n for d, n in staleness.items() if d > 0)
        out = {
            "rollout/staleness_mean": (sum(d * n for d, n in staleness.items()) / total) if total else 0.0,
            "rollout/staleness_max": float(max(staleness)) if total else 0.0,
            "rollout/stale_token_fraction": stale / total if total else 0.0,
            "rollout/loss_weight_mean": s.last_returned.loss_weight_sum / total if total else 0.0,
            "rollout/returned_groups": float(s.last_returned.num_groups),
            "rollout/returned_tokens": float(total),
            "rollout/truncated_fraction": (
                s.last_returned.num_truncated / s.last_returned.num_rollouts
                if s.last_returned.num_rollouts
                else 0.0
            ),
            "rollout/in_flight_groups": float(len(s.active)),
            "rollout/in_flight_sequences": float(sum(not q.done for g in s.active for q in g.sequences)),
            "rollout/pending_prompts": float(len(s.pending)),
            "rollout/completed_waiting_groups": float(len(s.completed)),
            "rollout/tokens_last_iteration": float(s.tokens_last_iteration),
            "rollout/sequences_last_iteration": float(s.sequences_last_iteration),
        }
        for segments, n in sorted(s.segments_histogram.items()):
            out[f"rollout/segments_hist/{segments}"] = float(n)
        return out

    # ---- checkpointing ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The full state as plain JSON types (prompts queued, segments in flight, groups waiting)."""
        return json.loads(self._state.model_dump_json())

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by `state_dict`. Raises PartialRolloutStateError naming the field if it
        comes from an incompatible configuration or is malformed."""
        if not isinstance(state, dict):
            raise PartialRolloutStateError(
                f"partial-rollout state must be a dict, got {type(state).__name__}"
            )
        version = state.get("format_version")
        if version != STATE_FORMAT_VERSION:
            raise PartialRolloutStateError(
                f"partial-rollout state field format_version is {version!r}; this version reads "
                f"{STATE_FORMAT_VERSION}"
            )
        if state.get("group_size") != self.group_size:
            raise PartialRolloutStateError(
                f"partial-rollout state field group_size is {state.get('group_size')!r} but this run uses "
                f"group_size={self.group_size}: resume with the saved group size (num_generations_per_prompt) "
                "or start without the saved partial-rollout state (its in-flight responses are then dropped)"
            )
        saved_config = state.get("config") or {}
        for name in _STATE_BOUND_FIELDS:
            saved, now = saved_config.get(name), getattr(self.config, name)
            if saved != now:
                raise PartialRolloutStateError(
                    f"partial-rollout state field config.{name} is {saved!r} but this run sets "
                    f"partial_rollouts.{name}={now!r}: resume with {name}={saved!r} or start without the "
                    "saved partial-rollout state (its in-flight responses are then dropped)"
                )
        try:
            loaded = _ManagerState.model_validate(state)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = ".".join(str(p) for p in err["loc"])
            raise PartialRolloutStateError(f"partial-rollout state field {key}: {err['msg']}") from None
        self._check_loaded_invariants(loaded)
        # Settings that do not constrain saved sequences (admission, stale policy) follow the new config.
        loaded.config = self.config.model_dump()
        self._state = loaded

    # ---- internals -------------------------------------------------------------------------------------
    def _check_version(self, policy_version: int) -> None:
        if not isinstance(policy_version, int) or isinstance(policy_version, bool):
            raise TypeError(f"policy_version must be an int, got {type(policy_version).__name__}")
        last = self._state.last_version
        if last is not None and policy_version < last:
            raise ValueError(
                f"policy_version went backwards ({policy_version} after {last}): pass the number of "
                "optimizer updates made so far, which never decreases"
            )
        self._state.last_version = policy_version

    def _admit(self, policy_version: int) -> None:
        cfg = self.config
        free = len(self._state.pending)
        if cfg.max_in_flight_groups is not None:
            free = min(free, cfg.max_in_flight_groups - len(self._state.active) - len(self._state.completed))
        if cfg.prompts_per_iteration is not None:
            free = min(free, cfg.prompts_per_iteration)
        for _ in range(max(free, 0)):
            group = self._state.pending.pop(0)
            group.admitted_version = policy_version
            group.sequences = [_SequenceState() for _ in range(self.group_size)]
            self._state.active.append(group)

    def _schedule(self) -> list[tuple[_GroupState, int]]:
        """Unfinished responses that get a segment now: oldest groups first, so groups complete."""
        todo = [(g, i) for g in self._state.active for i, q in enumerate(g.sequences) if not q.done]
        if self.config.global_token_budget is not None:
            todo = todo[: self.config.global_token_budget // self.config.token_budget]
        return todo

    def _response_cap(self, group: _GroupState) -> int | None:
        caps = [c for c in (self.config.max_response_tokens, group.max_response_tokens) if c is not None]
        return min(caps) if caps else None

    def _allowance(self, group: _GroupState, seq: _SequenceState) -> int:
        cap = self._response_cap(group)
        budget = self.config.token_budget
        return budget if cap is None else min(budget, cap - len(seq.response_token_ids))

    def _generate_segments(
        self, generate_fn: GenerateFn, scheduled: list[tuple[_GroupState, int]], policy_version: int
    ) -> int:
        """One generate_fn call for all scheduled responses (one batch for the inference engine). A
        response closer to its length cap than `token_budget` keeps only the tokens it has room for; it
        then ends there as truncated, so the tokens cut off would never have been trained on."""
        if not scheduled:
            return 0
        allowances = [self._allowance(g, g.sequences[i]) for g, i in scheduled]
        max_new = max(allowances)
        contexts = [g.prompt_token_ids + g.sequences[i].response_token_ids for g, i in scheduled]
        chunks = generate_fn(contexts, max_new)
        _check_chunks(chunks, len(contexts), max_new)
        produced = 0
        for (group, i), chunk, allowance in zip(scheduled, chunks, allowances):
            if len(chunk.token_ids) > allowance:
                chunk = GenerationChunk(
                    chunk.token_ids[:allowance], chunk.logprobs[:allowance], finished=False
                )
            self._append_segment(group.sequences[i], chunk, policy_version, self._response_cap(group))
            produced += len(chunk.token_ids)
        return produced

    def _append_segment(
        self, seq: _SequenceState, chunk: GenerationChunk, policy_version: int, cap: int | None
    ) -> None:
        n = len(chunk.token_ids)
        seq.response_token_ids.extend(int(t) for t in chunk.token_ids)
        seq.behavior_logprobs.extend(float(x) for x in chunk.logprobs)
        seq.segment_versions.append(policy_version)
        seq.segment_lengths.append(n)
        if chunk.finished:
            seq.finish_reason = "stop"
        elif cap is not None and len(seq.response_token_ids) >= cap:
            seq.finish_reason = "max_response_tokens"
        elif len(seq.segment_lengths) >= self.config.max_segments:
            seq.finish_reason = "max_resumptions"

    def _move_completed(self) -> None:
        still_active = []
        for group in self._state.active:
            (self._state.completed if group.complete else still_active).append(group)
        self._state.active = still_active
        self._state.completed.sort(key=lambda g: g.order)

    def _hand_out(self, policy_version: int, max_groups: int | None) -> list[RolloutGroup]:
        n = len(self._state.completed) if max_groups is None else min(max_groups, len(self._state.completed))
        taken, self._state.completed = self._state.completed[:n], self._state.completed[n:]
        groups = [self._to_rollout_group(g, policy_version) for g in taken]
        summary = self._state.last_returned
        if summary.policy_version != policy_version:  # a new step: start a new summary
            summary = self._state.last_returned = _ReturnedSummary(policy_version=policy_version)
        counts: Counter[int] = Counter(summary.version_token_counts)
        summary.num_groups += len(groups)
        for group in groups:
            for r in group.rollouts:
                counts.update(r.token_versions)
                summary.num_rollouts += 1
                summary.num_truncated += int(r.truncated)
                summary.loss_weight_sum += math.fsum(r.loss_weights)
                hist = self._state.segments_histogram
                hist[r.num_segments] = hist.get(r.num_segments, 0) + 1
        summary.version_token_counts = dict(counts)
        return groups

    def _to_rollout_group(self, group: _GroupState, policy_version: int) -> RolloutGroup:
        rollouts = []
        for i, seq in enumerate(group.sequences):
            versions = [v for v, n in zip(seq.segment_versions, seq.segment_lengths) for _ in range(n)]
            weights = [self.config.stale_weight(policy_version - v) for v in versions]
            meta = dict(group.meta)
            meta.update(
                truncated=seq.finish_reason != "stop",
                finish_reason=seq.finish_reason,
                num_segments=len(seq.segment_lengths),
                sample_index=i,
            )
            rollouts.append(
                Rollout(
                    prompt_id=group.prompt_id,
                    prompt_token_ids=list(group.prompt_token_ids),
                    response_token_ids=list(seq.response_token_ids),
                    behavior_logprobs=list(seq.behavior_logprobs),
                    token_versions=versions,
                    loss_weights=weights,
                    num_segments=len(seq.segment_lengths),
                    segment_lengths=list(seq.segment_lengths),
                    meta=meta,
                )
            )
        return RolloutGroup(
            prompt_id=group.prompt_id,
            rollouts=rollouts,
            meta={"admitted_version": group.admitted_version, "order": group.order},
        )

    def _check_loaded_invariants(self, state: _ManagerState) -> None:
        for where, groups in (("active", state.active), ("completed", state.completed)):
            for gi, group in enumerate(groups):
                if len(group.sequences) != self.group_size:
                    raise PartialRolloutStateError(
                        f"partial-rollout state field {where}[{gi}].sequences has {len(group.sequences)} "
                        f"responses, expected group_size={self.group_size}"
                    )
                for si, seq in enumerate(group.sequences):
                    n = len(seq.response_token_ids)
                    if not (
                        n == len(seq.behavior_logprobs) == sum(seq.segment_lengths)
                        and len(seq.segment_versions) == len(seq.segment_lengths)
                        and seq.segment_versions == sorted(seq.segment_versions)
                    ):
                        raise PartialRolloutStateError(
                            f"partial-rollout state field {where}[{gi}].sequences[{si}]: response_token_ids, "
                            "behavior_logprobs, segment_lengths and segment_versions disagree (lengths, or "
                            "versions not non-decreasing)"
                        )
                    if len(seq.segment_lengths) > self.config.max_segments:
                        raise PartialRolloutStateError(
                            f"partial-rollout state field {where}[{gi}].sequences[{si}].segment_lengths has "
                            f"{len(seq.segment_lengths)} segments, more than max_resumptions + 1"
                        )


def _check_chunks(chunks: list[GenerationChunk], expected: int, max_new: int) -> None:
    if len(chunks) != expected:
        raise GenerationOutputError(
            f"generate_fn returned {len(chunks)} chunks for {expected} contexts: it must return one "
            "GenerationChunk per context, in order"
        )
    for i, chunk in enumerate(chunks):
        if len(chunk.token_ids) > max_new:
            raise GenerationOutputError(
                f"generate_fn chunk {i} has {len(chunk.token_ids)} tokens but max_new_tokens was {max_new}: "
                "the generator must respect the per-iteration token budget"
            )
        if len(chunk.logprobs) != len(chunk.token_ids):
            raise GenerationOutputError(
                f"generate_fn chunk {i} has {len(chunk.token_ids)} token_ids but {len(chunk.logprobs)} "
                "logprobs: every generated token needs the behaviour log-prob it was sampled with"
            )
        if not all(math.isfinite(x) for x in chunk.logprobs):
            raise GenerationOutputError(f"generate_fn chunk {i} has a non-finite behaviour log-prob")
