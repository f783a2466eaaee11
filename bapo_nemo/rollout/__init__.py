"""Partial rollouts and sample replay, framework-free (stdlib, pydantic, torch only).
See docs/partial_rollouts.md.

- `PartialRolloutManager`: responses generated in budgeted segments, each token tagged with its policy
  version and behaviour log-prob; only complete prompt groups leave; JSON-checkpointable.
- `ReplayBuffer`: completed groups reused across optimizer steps under a staleness bound.
- `split_minibatches`: several optimizer updates per rollout batch.
"""

from bapo_nemo.lazy_exports import lazy_exports

# each name is imported from its submodule on first use, so the config alone loads without torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "types": ["GenerateFn", "GenerationChunk", "PromptItem", "Rollout", "RolloutGroup"],
    "partial": ["GenerationOutputError", "PartialRolloutManager", "PartialRolloutStateError"],
    "config": ["PartialRolloutConfig", "PartialRolloutConfigError", "StaleSegments"],
    "replay": ["ReplayBuffer", "ReplayStateError", "split_minibatches"],
})
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
