"""NeMo-RL's aggregation of the loss's metrics, written out to check BAPOLossFn's metrics against."""

from __future__ import annotations

from typing import Any


def aggregate_like_nemo(per_rank_microbatch_metrics: list[list[list[dict[str, Any]]]]) -> dict[str, float]:
    """NeMo-RL's aggregation of loss metrics (its worker and driver halves), computed independently of it.

    Input: [data-parallel rank][global batch][micro-batch] -> metric dict (as returned by the loss).
    Worker: x / num_global_batches unless the name contains "_min"/"_max"; driver: np.sum over all,
    except probs_ratio(_clamped)_min (min) and _max (max), ignoring infinities.
    """
    lists: dict[str, list[float]] = {}
    for rank in per_rank_microbatch_metrics:
        num_gb = len(rank)
        for gb in rank:
            for mb in gb:
                for k, v in mb.items():
                    scaled = v if ("_min" in k or "_max" in k) else v / num_gb
                    lists.setdefault(k, []).append(scaled)
    out = {}
    for k, vs in lists.items():
        finite = [v for v in vs if v not in (float("inf"), float("-inf"))]
        if k in ("probs_ratio_min", "probs_ratio_clamped_min"):
            out[k] = min(finite) if finite else -1.0
        elif k in ("probs_ratio_max", "probs_ratio_clamped_max"):
            out[k] = max(finite) if finite else -1.0
        else:
            out[k] = float(sum(vs))
    return out
