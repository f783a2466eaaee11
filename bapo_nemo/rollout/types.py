"""Data that crosses the boundary of the partial-rollout manager: what goes in (prompts, generation
chunks) and what comes out (finished rollouts, complete prompt groups)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class PromptItem:
    """One prompt to roll out `group_size` times. `meta` travels with every rollout of the prompt (e.g.
    the reference answer for the reward function) and must be JSON-serialisable (it is checkpointed).
    `max_response_tokens` optionally caps this prompt's responses below the config's cap (e.g. what is
    left of the context window after a long prompt)."""

    prompt_id: str
    token_ids: list[int]
    meta: dict = field(default_factory=dict)
    max_response_tokens: int | None = None


@dataclass
class GenerationChunk:
    """What a generator produced for one context in one call: the new tokens, the behaviour log-prob of
    each (log pi_behaviour(token | context so far)), and whether the response ended (EOS/stop)."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool


GenerateFn = Callable[[list[list[int]], int], list[GenerationChunk]]
"""generate_fn(contexts, max_new_tokens) -> one GenerationChunk per context, at most max_new_tokens each.
A context is the prompt followed by the response tokens generated so far (continuation = re-feeding)."""


@dataclass
class Rollout:
    """A finished response, assembled from one or more segments.

    Per response token: `behavior_logprobs` (log-prob under the policy that sampled it), `token_versions`
    (the policy version that sampled it; non-decreasing along the response) and `loss_weights` (from the
    stale-segment policy, relative to the version the group was handed out at).
    `meta` holds the prompt's meta plus `truncated`, `finish_reason` (stop | max_resumptions |
    max_response_tokens), `num_segments` and `sample_index`.
    """

    prompt_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    loss_weights: list[float]
    num_segments: int
    segment_lengths: list[int]
    meta: dict

    @property
    def truncated(self) -> bool:
        return bool(self.meta.get("truncated", False))

    @property
    def finish_reason(self) -> str:
        return str(self.meta.get("finish_reason", ""))


@dataclass
class RolloutGroup:
    """All `group_size` rollouts of one prompt: GRPO's baseline needs the complete group."""

    prompt_id: str
    rollouts: list[Rollout]
    meta: dict = field(default_factory=dict)
