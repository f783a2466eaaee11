"""The NeMo-RL-free half of BAPOLossFn: everything that can be computed and tested without nemo_rl.

- `reference_logprobs`, `data_for_parent`: which log-probs the clipped ratio is taken against;
- `importance_weights_like_nemo`: ClippedPGLossFn's weights, so the search weighs tokens as the loss does;
- `bounds_to_epsilons`: BAPO's absolute bounds as NeMo-RL's clip epsilons;
- `nemo_step_metrics`: metrics scaled so NeMo-RL's aggregation yields per-step values (docs/nemo_rl.md,
  "Metrics"); no name contains "_min"/"_max", which that aggregation would sum un-averaged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from bapo_nemo.algorithm import ClipSearchResult

# Per-step metrics that are token-weighted means of a per-micro-batch value.
WEIGHTED_MEAN_METRICS = ("c_low", "c_high", "target_met", "steps")
# The positive share P / (P + N) is 0 / 0 without advantage mass: weighted by signal tokens (A != 0) only,
# and divided by the step's signal share on the driver (`step_signal.signal_weighted_shares`).
SIGNAL_WEIGHTED_METRICS = ("rho", "rho_initial")
# Per-step metrics that are shares of all valid tokens of the step.
TOKEN_SHARE_METRICS = (
    "pos_token_frac",
    "neg_token_frac",
    "clip_high_frac",
    "clip_low_frac",
    "dual_clip_frac",
)
PREFIX = "bapo/"


def bounds_to_epsilons(c_low: float, c_high: float) -> tuple[float, float]:
    """ClippedPGLossFn clips the ratio to [1 - ratio_clip_min, 1 + ratio_clip_max]: epsilons, not bounds."""
    return 1.0 - c_low, c_high - 1.0


def reference_logprobs(data: Mapping[str, torch.Tensor], ratio_reference: str) -> torch.Tensor:
    """Log-probs the clipped ratio is taken against, shifted like ClippedPGLossFn does ([:, 1:]).

    proximal: prev_logprobs (current weights at the start of policy.train()).
    behavior: generation_logprobs (the policy that sampled the tokens).
    """
    key = {"proximal": "prev_logprobs", "behavior": "generation_logprobs"}[ratio_reference]
    return data[key][:, 1:]


def data_for_parent(data, ratio_reference: str):
    """The data ClippedPGLossFn should see.

    proximal: unchanged. behavior: a shallow copy whose prev_logprobs *is* generation_logprobs, so the
    parent's ratio is pi_theta / pi_behavior and its importance weight exp(prev - gen) is exactly 1
    (the behaviour gap now sits inside the clipped ratio instead of a separate weight). The parent's
    mismatch metrics (token_mult_prob_error, gen_kl_error, ...) then read 1/0; BAPOLossFn logs the real
    proximal-vs-behaviour gap under bapo/behavior_kl.
    """
    if ratio_reference == "proximal":
        return data
    copied = data.__class__()
    copied.update(data)
    copied["prev_logprobs"] = data["generation_logprobs"]
    return copied


def importance_weights_like_nemo(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    truncation_type: str | None,
    truncation_max: float | None,
    truncation_min: float | None,
) -> torch.Tensor:
    """The token-level importance weights ClippedPGLossFn (v0.7.0) multiplies the clipped loss by when
    `use_importance_sampling_correction` is on: w = exp(prev - gen) (NaN/inf -> 0), then
    tis:          clamp(w, min or 0, max)
    icepop:       w where min <= w <= max, else 0
    seq-mask-tis: w, times 0 for sequences whose geometric-mean weight exp(mean_t log w) is outside [min, max]
    Inputs are already shifted ([:, 1:]). Detached: weights never carry gradient.
    """
    prev_logprobs, generation_logprobs = prev_logprobs.detach(), generation_logprobs.detach()
    weights = torch.nan_to_num(
        torch.exp(prev_logprobs - generation_logprobs), nan=0.0, posinf=0.0, neginf=0.0
    )
    if truncation_max is None:
        return weights
    if truncation_type == "tis":
        return torch.clamp(
            weights, min=truncation_min if truncation_min is not None else 0.0, max=truncation_max
        )
    if truncation_type == "icepop":
        keep = (weights >= truncation_min) & (weights <= truncation_max)
        return torch.where(keep, weights, torch.zeros_like(weights))
    if truncation_type == "seq-mask-tis":
        log_w = torch.nan_to_num(prev_logprobs - generation_logprobs, nan=0.0, posinf=0.0, neginf=0.0)
        # NeMo-RL's masked_mean: sum(x * m) / (sum(m) + 1e-8)
        seq_mean = (log_w * token_mask).sum(-1) / (token_mask.sum(-1) + 1e-8)
        geo = torch.exp(seq_mean)
        keep = ((geo >= truncation_min) & (geo <= truncation_max)).to(weights.dtype)
        return weights * keep.unsqueeze(-1)
    raise ValueError(
        f"loss_fn.truncated_importance_sampling_type={truncation_type!r}: expected tis, icepop or seq-mask-tis"
    )


def token_sign_counts(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    c_low: float,
    c_high: float,
    dual_clip: float | None,
) -> dict[str, float]:
    """Counts (local to this call) behind the clip-fraction metrics."""
    valid = mask > 0
    pos, neg = valid & (advantages > 0), valid & (advantages < 0)
    dual = neg & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(neg)
    stats = (
        torch.stack(
            [
                valid.sum(),
                pos.sum(),
                neg.sum(),
                (pos & (ratio > c_high)).sum(),
                (neg & (ratio < c_low)).sum(),
                dual.sum(),
            ]
        )
        .to(torch.float64)
        .tolist()
    )
    return dict(zip(("valid", "pos", "neg", "clip_high", "clip_low", "dual"), stats))


def nemo_step_metrics(
    result: ClipSearchResult, counts: dict[str, float], global_valid_toks: float
) -> dict[str, float]:
    """BAPO metrics for one loss call, scaled for NeMo-RL's sum-over-micro-batches aggregation.

    Each per-micro-batch value v (bounds, target met, search steps) is emitted as
    v * n_local / global_valid_toks: summed over the micro-batches and data-parallel ranks of one
    optimizer step this is the token-weighted mean of v, and NeMo-RL's division by the number of
    optimizer steps per train() call averages over those steps. Token shares are counts / global tokens.
    rho and rho_initial are weighted by the local signal tokens (A != 0) instead: their sum over the
    step divided by the summed pos + neg token shares is the signal-weighted mean, undefined (and not
    logged) for a step without signal.
    """
    g = float(global_valid_toks)
    if g <= 0:
        return {}
    weight, signal = counts["valid"] / g, (counts["pos"] + counts["neg"]) / g
    values = {
        "c_low": result.c_low,
        "c_high": result.c_high,
        "target_met": float(result.target_met),
        "steps": float(result.steps),
    }
    metrics = {PREFIX + k: v * weight for k, v in values.items()}
    metrics.update({PREFIX + "rho": result.rho * signal, PREFIX + "rho_initial": result.rho_initial * signal})
    metrics.update(
        {
            PREFIX + "pos_token_frac": counts["pos"] / g,
            PREFIX + "neg_token_frac": counts["neg"] / g,
            PREFIX + "clip_high_frac": counts["clip_high"] / g,
            PREFIX + "clip_low_frac": counts["clip_low"] / g,
            PREFIX + "dual_clip_frac": counts["dual"] / g,
        }
    )
    return metrics
