"""Partial rollouts and sample replay, framework-free (stdlib, pydantic, torch only).

- `PartialRolloutManager`: responses generated in budgeted segments across iterations, each token tagged
  with its policy version and behaviour log-prob; only complete prompt groups leave; JSON-checkpointable.
- `ReplayBuffer`: completed groups reused across optimizer steps under a staleness bound.
- `split_minibatches`: several optimizer updates per rollout batch.
See docs/partial_rollouts.md.
"""

from bapo_nemo.rollout.config import PartialRolloutConfig, PartialRolloutConfigError, StaleSegments
from bapo_nemo.rollout.partial import (
    GenerationOutputError,
    PartialRolloutManager,
    PartialRolloutStateError,
)
from bapo_nemo.rollout.replay import ReplayBuffer, ReplayStateError, split_minibatches
from bapo_nemo.rollout.types import GenerateFn, GenerationChunk, PromptItem, Rollout, RolloutGroup

__all__ = [
    "GenerateFn",
    "GenerationChunk",
    "GenerationOutputError",
    "PartialRolloutConfig",
    "PartialRolloutConfigError",
    "PartialRolloutManager",
    "PartialRolloutStateError",
    "PromptItem",
    "ReplayBuffer",
    "ReplayStateError",
    "Rollout",
    "RolloutGroup",
    "StaleSegments",
    "split_minibatches",
]
