"""BAPO: Balanced Policy Optimization with Adaptive Clipping (Xi et al., arXiv 2510.18927).

Everything of BAPO's math lives here: the positive-share measure (Eq. 8), the bound search (Algorithm 1)
and the clipped surrogate it feeds (Algorithm 1, line 20). torch only; runtimes call these functions.

Notation: r = exp(clamp(logp - logp_old, -20, 20)) is the per-token importance ratio, A the advantage,
[c_low, c_high] absolute ratio bounds. The search walks the paper's path on an integer grid, but evaluates
every grid point at once from two small histograms, so it costs one collective and one host sync instead
of up to ~51 of each (see `search_clip_bounds`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from bapo_nemo.algorithm.config import BAPOConfig

LOG_RATIO_CLAMP = 20.0
# A share within this of rho0 counts as reaching it: keeps exact ties (P/(P+N) == rho0 in exact
# arithmetic) from depending on summation order.
_RHO_TOLERANCE = 1e-12

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the processes that share one optimizer step and returns the sum."""


class NonFiniteInputError(FloatingPointError):
    """NaN/inf in the log-probs, ratios or advantages of unmasked tokens."""


def process_group_all_reduce(group=None) -> AllReduce:
    """An `AllReduce` over a torch.distributed process group (under Megatron: the data-parallel group;
    never WORLD, since with pipeline parallelism only the last stage computes the loss)."""
    import torch.distributed as dist

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return t

    return all_reduce


@dataclass(frozen=True)
class ClipSearchResult:
    """Bounds chosen for one update and the statistics behind them (all global over the reduction)."""

    c_low: float
    c_high: float
    rho: float  # positive share at the chosen bounds
    rho_initial: float  # positive share at the starting bounds (c_low_min, c_high_min)
    target_met: bool
    steps: int  # bound moves made by Algorithm 1 (0 = the starting bounds were enough)
    positive_mass: float  # P at the chosen bounds
    negative_mass: float  # N at the chosen bounds
    num_tokens: float  # unmasked tokens that entered the statistics
    nonfinite_tokens: int  # tokens dropped because of NaN/inf (only with nonfinite="mask")

    def as_metrics(self, prefix: str = "bapo/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}


# --------------------------------------------------------------------------------------------------
# Eq. 8: the positive share rho = P / (P + N), for every grid point at once
# --------------------------------------------------------------------------------------------------
def _share(p: torch.Tensor, n: torch.Tensor, config: BAPOConfig) -> torch.Tensor:
    """Positive share, and the quantity compared with the target.

    paper: rho = P / (P + N), 1.0 when N = 0 (no negative mass: nothing to balance).
    reference: the authors' code compares P / (N + eps) with q = rho0 / (1 - rho0); we report the
    equivalent share q' / (1 + q') with q' = P / (N + eps) so both orders log the same quantity.
    """
    if config.order == "reference":
        pn = torch.where(n > 0, p / (n + config.pn_eps), torch.full_like(p, math.inf))
        return torch.where(torch.isinf(pn), torch.ones_like(pn), pn / (1.0 + pn))
    total = p + n
    return torch.where(n > 0, p / total.clamp_min(torch.finfo(total.dtype).tiny), torch.ones_like(p))


def _reduced_histograms(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    weight: torch.Tensor,
    c_low_grid: torch.Tensor,
    c_high_grid: torch.Tensor,
    dual_clip: float | None,
    nonfinite_tokens: torch.Tensor,
    all_reduce: AllReduce | None,
) -> torch.Tensor:
    """One pass over the tokens: bucket each ratio against its grid and sum A*r and A per bucket.

    Positive tokens (A > 0) are bucketed on the c_high grid, bucket b = first k with c_high[k] >= r, so
    min(r, c_high[k]) = r exactly for b <= k. Negative tokens on the c_low grid, b = #{j: c_low[j] <= r},
    so max(r, c_low[j]) = r exactly for j < b. Returns the reduced vector
    [pos A*r (I+2) | pos A (I+2) | neg |A|*r (J+2) | neg |A| (J+2) | neg |A|*r under dual clip (J+2) | n_tok | n_bad].
    """
    n_hi, n_lo = c_high_grid.numel() + 1, c_low_grid.numel() + 1
    r = ratio.reshape(-1).to(torch.float64)
    a = advantages.reshape(-1).to(torch.float64) * weight.reshape(-1).to(torch.float64)
    pos, neg = a > 0, a < 0
    b_hi = torch.searchsorted(c_high_grid, r, right=False)
    b_lo = torch.searchsorted(c_low_grid, r, right=True)
    # One bincount per weight: positive buckets occupy [0, n_hi), negative ones [n_hi, n_hi + n_lo);
    # zero-advantage and masked tokens go to a discarded last bin.
    dump = n_hi + n_lo
    index = torch.where(pos, b_hi, torch.where(neg, n_hi + b_lo, torch.full_like(b_hi, dump)))
    abs_a = a.abs()
    sum_ar = torch.bincount(index, weights=abs_a * r, minlength=dump + 1)[:dump]
    sum_a = torch.bincount(index, weights=abs_a, minlength=dump + 1)[:dump]
    if dual_clip is not None:
        # Negative tokens with r > dual_clip sit at the constant -A*c: no gradient.
        ar_dual = torch.where(neg & (r <= dual_clip), abs_a * r, torch.zeros_like(r))
        neg_ar_dual = torch.bincount(index, weights=ar_dual, minlength=dump + 1)[n_hi:dump]
    else:
        neg_ar_dual = sum_ar[n_hi:dump]
    counts = torch.stack([(weight.reshape(-1) > 0).sum().to(torch.float64), nonfinite_tokens.to(torch.float64)])
    packed = torch.cat([sum_ar[:n_hi], sum_a[:n_hi], sum_ar[n_hi:], sum_a[n_hi:], neg_ar_dual, counts])
    if all_reduce is not None:
        packed = all_reduce(packed)
    return packed


def _masses_on_grid(packed: torch.Tensor, c_low_grid, c_high_grid, measure: str):
    """P for every c_high and N for every c_low, from the reduced histograms (host side, tiny).

    value (Eq. 8):   P(h) = sum_{A>0} A min(r, h)          N(l) = sum_{A<0} |A| max(r, l)
    gradient:        P(h) = sum_{A>0, r<=h} A r            N(l) = sum_{A<0, r>=l, r<=dual} |A| r
    The gradient measure counts only tokens whose surrogate still has a gradient (|d(rA)| = |A| r).
    """
    n_hi, n_lo = c_high_grid.numel() + 1, c_low_grid.numel() + 1
    pos_ar, pos_a, neg_ar, neg_a, neg_ar_dual, counts = torch.split(packed, [n_hi, n_hi, n_lo, n_lo, n_lo, 2])
    pos_ar_below = torch.cumsum(pos_ar, 0)[:-1]  # buckets b <= k: r <= c_high[k]
    pos_a_above = pos_a.sum() - torch.cumsum(pos_a, 0)[:-1]  # buckets b > k: r > c_high[k]
    neg_ar_above = neg_ar.sum() - torch.cumsum(neg_ar, 0)[:-1]  # buckets b > j: r >= c_low[j]
    neg_a_below = torch.cumsum(neg_a, 0)[:-1]  # buckets b <= j: r < c_low[j]
    if measure == "value":
        p = pos_ar_below + c_high_grid * pos_a_above
        n = neg_ar_above + c_low_grid * neg_a_below
    else:
        p = pos_ar_below
        n = neg_ar_dual.sum() - torch.cumsum(neg_ar_dual, 0)[:-1]
    return p, n, counts


def _search_path(config: BAPOConfig, n_low: int, n_high: int) -> tuple[list[int], list[int]]:
    """Grid indices (j for c_low, i for c_high) visited by the sequential search, in order.

    paper (Algorithm 1): while rho < rho0 and c_low + d2 <= b-: raise c_high by d1 if it stays <= b+,
    else raise c_low by d2. So c_high climbs first, then c_low; and the loop only runs at all when the
    c_low grid has a second point.
    reference (authors' code): c_low climbs to its max first, then c_high.
    """
    last_low, last_high = n_low - 1, n_high - 1
    if not config.enabled:
        return [0], [0]
    if config.order == "paper":
        if last_low == 0:
            return [0], [0]
        lows = [0] * (last_high + 1) + list(range(1, last_low + 1))
        highs = list(range(last_high + 1)) + [last_high] * last_low
    else:
        lows = list(range(last_low + 1)) + [last_low] * last_high
        highs = [0] * (last_low + 1) + list(range(1, last_high + 1))
    return lows, highs


def search_clip_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: BAPOConfig,
    all_reduce: AllReduce | None = None,
    weights: torch.Tensor | None = None,
) -> ClipSearchResult:
    """Choose (c_low, c_high) for one update: BAPO's Algorithm 1, exactly, in one pass.

    Returns the bounds the sequential Algorithm 1 (order "paper") or the authors' loop (order
    "reference") would return: the first point of the search path whose positive share rho (Eq. 8,
    measured by `config.measure`) reaches rho0, or the path's last point (saturated bounds,
    target_met=False). Every grid point is evaluated from histograms built in one pass; `all_reduce`
    is called exactly once (sum over the ranks of one optimizer step) and the host syncs once.

    ratio, advantages, mask: same shape; mask is 0/1 (or a non-negative token weight). advantages may
    also be per-sequence, broadcastable to ratio. weights: optional per-token multipliers of the loss
    (importance-sampling correction); used in the measure except in reference order (the authors' code
    applies them after the search).
    """
    if advantages.shape != ratio.shape:
        advantages = advantages.expand_as(ratio)
    weight = mask.to(torch.float64)
    if weights is not None and config.order == "paper":
        weight = weight * weights.detach().to(torch.float64)
    ratio = ratio.detach()
    bad = (~torch.isfinite(ratio) | ~torch.isfinite(advantages)) & (mask > 0)
    nonfinite = bad.sum()
    # Keep NaNs out of the sums in both policies: with "error" the *global* count, reduced with the
    # statistics, makes every rank raise together instead of one rank raising and the others hanging.
    weight = torch.where(bad, torch.zeros_like(weight), weight)
    ratio = torch.where(bad, torch.ones_like(ratio), ratio)
    advantages = torch.where(bad, torch.zeros_like(advantages), advantages)

    device = ratio.device
    low_grid = torch.tensor(config.c_low_grid(), dtype=torch.float64, device=device)
    high_grid = torch.tensor(config.c_high_grid(), dtype=torch.float64, device=device)
    packed = _reduced_histograms(
        ratio, advantages, weight, low_grid, high_grid, config.dual_clip, nonfinite, all_reduce
    )
    packed = packed.cpu()  # the one host sync
    p, n, counts = _masses_on_grid(packed, low_grid.cpu(), high_grid.cpu(), config.measure)
    num_tokens, n_bad = float(counts[0]), int(counts[1])
    if n_bad and config.nonfinite == "error":
        raise NonFiniteInputError(
            f"{n_bad} unmasked token(s) have a non-finite importance ratio or advantage (summed over all "
            "ranks). Check the log-probs and rewards upstream, or set bapo.nonfinite=mask to drop and count them."
        )

    lows, highs = _search_path(config, low_grid.numel(), high_grid.numel())
    lows_t, highs_t = torch.tensor(lows), torch.tensor(highs)
    p_path, n_path = p[highs_t], n[lows_t]
    rho_path = _share(p_path, n_path, config)
    met = rho_path >= (config.rho0 - _RHO_TOLERANCE)
    stop = int(torch.argmax(met.to(torch.int8))) if bool(met.any()) else len(lows) - 1
    return ClipSearchResult(
        c_low=float(low_grid[lows[stop]]),
        c_high=float(high_grid[highs[stop]]),
        rho=float(rho_path[stop]),
        rho_initial=float(rho_path[0]),
        target_met=bool(met[stop]),
        steps=stop,
        positive_mass=float(p_path[stop]),
        negative_mass=float(n_path[stop]),
        num_tokens=num_tokens,
        nonfinite_tokens=n_bad,
    )


# --------------------------------------------------------------------------------------------------
# Algorithm 1, line 20: the clipped surrogate with explicit bounds
# --------------------------------------------------------------------------------------------------
def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """r_t = exp(clamp(logp_theta - logp_old, -20, 20)): the clamp keeps exp finite for stale data."""
    return torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    c_low: float,
    c_high: float,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Per-token loss -min(r A, clip(r, c_low, c_high) A), with the dual clip for A < 0:
    max(that, ... ) capped at -c A (Ye et al. 2020), as in the authors' code."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, c_low, c_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    global_num_tokens: float | torch.Tensor,
    c_low: float = 0.8,
    c_high: float = 1.2,
    dual_clip: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain PPO/GRPO token-level loss with fixed bounds: sum over tokens / global token count.

    Dividing by the global count (not the micro-batch's) makes micro-batch losses add up to the loss of
    the whole batch, as NeMo-RL does with `global_valid_toks`.
    """
    ratio = importance_ratio(logprobs, old_logprobs)
    token_loss = clipped_surrogate(ratio, advantages, c_low, c_high, dual_clip)
    if importance_weights is not None:
        token_loss = token_loss * importance_weights
    return (token_loss * mask).sum() / global_num_tokens


def bapo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    global_num_tokens: float | torch.Tensor,
    config: BAPOConfig,
    bounds: ClipSearchResult | None = None,
    importance_weights: torch.Tensor | None = None,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """BAPO's loss for one (micro-)batch: choose the bounds (unless `bounds` is given, e.g. one search per
    optimizer step) and return (token-sum loss / global_num_tokens, metrics).

    logprobs [B, T] carries the gradient; old_logprobs [B, T] is the reference the ratio is taken
    against; advantages [B, T] or [B, 1]; mask [B, T] (0/1). Metrics are global over `all_reduce` for
    the search statistics and local to this call for the token statistics (clip fractions, KL, ratio).
    """
    advantages = advantages.expand_as(logprobs) if advantages.shape != logprobs.shape else advantages
    mask = mask.to(logprobs.dtype)
    bad_logp = (~torch.isfinite(logprobs.detach()) | ~torch.isfinite(old_logprobs)) & (mask > 0)
    ratio = importance_ratio(logprobs, old_logprobs)
    # +inf log-probs would be clamped into finite ratios: treat any non-finite log-prob as bad.
    ratio_for_search = torch.where(bad_logp, torch.full_like(ratio, math.nan), ratio.detach())
    if bounds is None:
        bounds = search_clip_bounds(ratio_for_search, advantages, mask, config, all_reduce, importance_weights)
    elif config.nonfinite == "error":
        n_bad = int((bad_logp | (~torch.isfinite(advantages) & (mask > 0))).sum())
        if n_bad:
            raise NonFiniteInputError(
                f"{n_bad} unmasked token(s) have non-finite log-probs or advantages; "
                "set bapo.nonfinite=mask to drop and count them."
            )
    bad = bad_logp | (~torch.isfinite(advantages) & (mask > 0))
    if config.nonfinite == "mask":
        mask = torch.where(bad, torch.zeros_like(mask), mask)
        advantages = torch.where(bad, torch.zeros_like(advantages), advantages)
        ratio = torch.where(bad, torch.ones_like(ratio), ratio)

    token_loss = clipped_surrogate(ratio, advantages, bounds.c_low, bounds.c_high, config.dual_clip)
    if importance_weights is not None:
        token_loss = token_loss * importance_weights
    # torch.where, not a product: a NaN on a masked position must not leak into the sum.
    loss = torch.where(mask > 0, token_loss * mask, torch.zeros_like(token_loss)).sum() / global_num_tokens

    with torch.no_grad():
        metrics = bounds.as_metrics()
        metrics.update(_token_metrics(ratio.detach(), logprobs.detach(), old_logprobs, advantages, mask, bounds, config))
    return loss, metrics


def _token_metrics(ratio, logprobs, old_logprobs, advantages, mask, bounds, config) -> dict[str, float]:
    """Clip fractions by advantage sign, approx KL (k3) and mean ratio over this call's unmasked tokens."""
    valid = mask > 0
    pos, neg = valid & (advantages > 0), valid & (advantages < 0)
    pos_clipped = pos & (ratio > bounds.c_high)
    neg_clipped = neg & (ratio < bounds.c_low)
    dual = neg & (ratio > config.dual_clip) if config.dual_clip is not None else torch.zeros_like(neg)
    log_ratio = torch.where(valid, torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)
    k3 = torch.exp(-log_ratio) - 1 + log_ratio  # Schulman's unbiased, non-negative KL estimator
    safe_ratio = torch.where(valid, ratio, torch.zeros_like(ratio))
    stats = torch.stack(
        [
            valid.sum(), pos.sum(), neg.sum(), pos_clipped.sum(), neg_clipped.sum(), dual.sum(),
            k3.sum(), safe_ratio.sum(),
        ]
    ).to(torch.float64).tolist()
    n_valid, n_pos, n_neg, n_pos_clip, n_neg_clip, n_dual, k3_sum, ratio_sum = stats

    def frac(a: float, b: float) -> float:
        return a / b if b > 0 else 0.0

    return {
        "bapo/clipfrac_pos": frac(n_pos_clip, n_pos),
        "bapo/clipfrac_neg": frac(n_neg_clip, n_neg),
        "bapo/clipfrac_dual": frac(n_dual, n_neg),
        "bapo/approx_kl": frac(k3_sum, n_valid),
        "bapo/ratio_mean": frac(ratio_sum, n_valid),
        "bapo/tokens_pos": n_pos,
        "bapo/tokens_neg": n_neg,
    }
