"""BAPO's math: config, bound search and loss. Depends on torch and pydantic (numba, when present, fuses
the search's token pass on CPU)."""

from bapo_nemo.algorithm.bapo import (
    AllReduce,
    ClipSearchResult,
    NonFiniteInputError,
    bapo_policy_loss,
    clipped_policy_loss,
    clipped_surrogate,
    importance_ratio,
    process_group_all_reduce,
    search_clip_bounds,
)
from bapo_nemo.algorithm.config import BAPOConfig, BAPOConfigError

__all__ = [
    "AllReduce",
    "BAPOConfig",
    "BAPOConfigError",
    "ClipSearchResult",
    "NonFiniteInputError",
    "bapo_policy_loss",
    "clipped_policy_loss",
    "clipped_surrogate",
    "importance_ratio",
    "process_group_all_reduce",
    "search_clip_bounds",
]
