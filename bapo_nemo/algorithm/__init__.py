"""BAPO's math: config, bound search and loss. Depends on torch and pydantic (numba, when present, fuses
the search's token pass on CPU)."""

from bapo_nemo.lazy_exports import lazy_exports

# each name is imported from its submodule on first use, so the config alone loads without torch
__getattr__, __dir__ = lazy_exports(__name__, {
    "bapo": [
        "AllReduce", "ClipSearchResult", "NonFiniteInputError", "bapo_policy_loss", "clipped_policy_loss",
        "clipped_surrogate", "importance_ratio", "process_group_all_reduce", "search_clip_bounds",
    ],
    "config": ["BAPOConfig", "BAPOConfigError"],
})
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
