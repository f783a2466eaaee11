"""BAPO: Balanced Policy Optimization with Adaptive Clipping (Xi et al., arXiv 2510.18927).

All of BAPO's math: the positive-share measure (Eq. 8), the bound search (Algorithm 1) and the clipped
surrogate it feeds (Algorithm 1, line 20); torch only, the runtimes call these functions. r is the
per-token ratio exp(clamp(logp - logp_old, -20, 20)), A the advantage, [c_low, c_high] absolute bounds.
The search evaluates the whole grid at once from two histograms (docs/algorithm.md).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bapo_nemo.algorithm import fused_cpu
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
    """Bounds chosen for one update and the statistics behind them, global over the reduction."""

    c_low: float
    c_high: float
    rho: float  # positive share at the chosen bounds
    rho_initial: float  # positive share at the starting bounds (c_low_min, c_high_min)
    target_met: bool
    steps: int  # bound moves made by Algorithm 1 (0 = the starting bounds were enough)
    positive_mass: float  # P at the chosen bounds
    negative_mass: float  # N at the chosen bounds
    num_tokens: float  # unmasked, finite tokens that entered the statistics
    nonfinite_tokens: int  # unmasked tokens with NaN/inf ratio or advantage (dropped with nonfinite="mask")
    tokens_pos: float  # tokens with A > 0
    tokens_neg: float  # tokens with A < 0
    clipfrac_pos: float  # share of A > 0 tokens above c_high (no gradient)
    clipfrac_neg: float  # share of A < 0 tokens below c_low (no gradient)
    clipfrac_dual: float  # share of A < 0 tokens above the dual-clip constant (no gradient)
    ratio_mean: float  # mean importance ratio
    approx_kl: float  # mean of k3 = (r - 1) - log r, KL(old || new) for tokens sampled from old

    def as_metrics(self, prefix: str = "bapo/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}


# --------------------------------------------------------------------------------------------------
# Eq. 8: the positive share rho = P / (P + N), for every grid point at once
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Edges:
    """Bucket edges shared by both bounds, so one lookup places every token.

    With b = #{edges < r}: the first L edges are the c_low grid shifted one float down (so "edge < r"
    means "c_low <= r": a negative token at exactly c_low still has gradient), then the H c_high points
    ("c_high < r": clipped), then the dual-clip constant if any ("c < r").
    """

    low: tuple[float, ...]
    high: tuple[float, ...]
    dual: float | None

    @property
    def n_bins(self) -> int:
        return len(self.low) + len(self.high) + (self.dual is not None) + 1

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """The edges (on the host) as the ratios' dtype compares them: the shift is one float of that dtype."""
        low = torch.nextafter(torch.tensor(self.low, dtype=dtype), torch.tensor(-math.inf, dtype=dtype))
        rest = torch.tensor(list(self.high) + ([self.dual] if self.dual is not None else []), dtype=dtype)
        return torch.cat([low, rest])


# Finer lookup tables than this fall back to a binary search (only for pathological grids).
_MAX_LOOKUP_CELLS = 1 << 16
# Ratios of these dtypes are bucketed through their bit patterns (other float dtypes via float32).
_BITS_OF = {torch.float32: (torch.int32, 32), torch.float64: (torch.int64, 64)}


@functools.lru_cache(maxsize=64)
def _lookup_tables(edge_bits: tuple[int, ...], int_dtype: torch.dtype, width: int, device: str):
    """Tables that place a ratio among the edges from its bit pattern, or None (use a binary search).

    Non-negative floats order like their bit patterns read as integers. Cut the bit patterns into cells
    by their top bits (`bits >> shift`), coarse enough for a small table and fine enough that each cell
    holds at most one edge. Then #{edges < r} = below[cell] + (bits(r) > inside[cell]), where `below`
    counts the edges under the cell and `inside` is the cell's own edge (the dtype's max if none).
    """
    if len(set(edge_bits)) < len(edge_bits) or min(edge_bits) < 0:
        return None  # tied or negative edges: a cell would need two edges
    shift = next(s for s in range(width - 2, -1, -1) if len({b >> s for b in edge_bits}) == len(edge_bits))
    # One empty cell either side: every bit pattern outside the edges' cells clamps to an empty cell
    # whose `below` is right for it (0 under the edges; all of them above, incl. +inf and NaN).
    first, last = (edge_bits[0] >> shift) - 1, (edge_bits[-1] >> shift) + 1
    if last - first + 1 > _MAX_LOOKUP_CELLS:
        return None
    below = [bisect.bisect_left(edge_bits, (first + c) << shift) for c in range(last - first + 1)]
    inside = [torch.iinfo(int_dtype).max] * len(below)
    for b in edge_bits:
        inside[(b >> shift) - first] = b
    as_tensor = functools.partial(torch.tensor, dtype=int_dtype, device=device)
    return shift, first, last, as_tensor(below), as_tensor(inside)


def _tables_for(r: torch.Tensor, edges: torch.Tensor):
    """(integer view dtype, `_lookup_tables`) for ratios like `r`, or (None, None): binary search."""
    int_dtype, width = _BITS_OF.get(r.dtype, (None, 0))
    if int_dtype is None:
        return None, None
    edge_bits = tuple(int(b) for b in edges.to(r.dtype).view(int_dtype).tolist())
    return int_dtype, _lookup_tables(edge_bits, int_dtype, width, str(r.device))


def _bucket(r: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """#{edges < r} per token, exactly, for sorted host-side `edges` of r's dtype (any shape of r).

    A binary search (`searchsorted`) costs about as much as the whole plain loss on CPU; this is five
    integer passes over the tokens and two lookups in tables of ~150 entries (`_lookup_tables`).
    """
    if r.dtype not in _BITS_OF and r.is_floating_point():
        # float16/bfloat16 widen to float32 exactly, so the comparisons are unchanged.
        r, edges = r.float(), edges.float()
    int_dtype, tables = _tables_for(r, edges)
    if tables is None:
        return torch.searchsorted(edges.to(r.device), r)
    shift, first, last, below, inside = tables
    bits = r.contiguous().view(int_dtype)
    # Arithmetic shift: negative patterns (-0.0, negative NaN) stay negative and clamp to the first cell.
    cell = (bits >> shift).clamp_(first, last).sub_(first).reshape(-1)
    b = below.index_select(0, cell).view(r.shape)
    return b.add_(bits > inside.index_select(0, cell).view(r.shape))


def _edges(config: BAPOConfig) -> _Edges:
    return _Edges(tuple(config.c_low_grid()), tuple(config.c_high_grid()), config.dual_clip)


def _share(p: torch.Tensor, n: torch.Tensor, config: BAPOConfig) -> torch.Tensor:
    """Positive share, and the quantity compared with the target.

    paper: rho = P / (P + N), 1.0 when N = 0 (no negative mass: nothing to balance).
    reference: the authors' code compares P / (N + eps) with q = rho0 / (1 - rho0); we report the
    equivalent share q' / (1 + q') with q' = P / (N + eps), so both orders log the same quantity.
    """
    if config.order == "reference":
        pn = torch.where(n > 0, p / (n + config.pn_eps), torch.full_like(p, math.inf))
        return torch.where(torch.isinf(pn), torch.ones_like(pn), pn / (1.0 + pn))
    total = p + n
    return torch.where(n > 0, p / total.clamp_min(torch.finfo(total.dtype).tiny), torch.ones_like(p))


_ROWS = 3  # per-bin statistics: token count, sum |A| r, sum |A|


def _token_statistics(ratio, advantages, mask, weights, edges: _Edges, with_abs_a: bool, log_ratio=None):
    """The only pass over the tokens; returns [histograms (3 x bins) | sum r | sum log r] in float64.

    Each token gets a bin code: [0, U) positive, [U, 2U) negative and [2U, 3U) zero-advantage tokens by
    bucket, 3U masked. Per bin: token count, sum |A| r, and sum |A| (value measure only, else zeros).
    The sums of r and log r over unmasked tokens feed the mean-ratio and KL metrics. A NaN/inf ratio or
    advantage makes these sums non-finite, which the caller detects on the host without another pass.

    `advantages` may be per sequence ([B, 1] against [B, T] ratios): the sign work is then per sequence.
    """
    u = edges.n_bins
    if ratio.device.type == "cpu" and fused_cpu.available():
        int_dtype, tables = _tables_for(ratio, edges.tensor(ratio.dtype))
        if tables is not None:  # the same numbers in one fused loop (fused_cpu.py)
            hist = torch.zeros(_ROWS, 3 * u + 1, dtype=torch.float64)
            totals = torch.zeros(2, dtype=torch.float64)
            fused_cpu.token_statistics(ratio, advantages, mask.detach(), weights, log_ratio, int_dtype, tables,
                                       u, with_abs_a, hist, totals)
            return torch.cat([hist.reshape(-1), totals])
    return _token_statistics_eager(ratio, advantages, mask, weights, edges, with_abs_a, log_ratio)


def _token_statistics_eager(ratio, advantages, mask, weights, edges: _Edges, with_abs_a: bool,
                            log_ratio=None):
    """`_token_statistics` in PyTorch ops: any device and dtype (GPUs take this path)."""
    u = edges.n_bins
    n_bins = 3 * u + 1
    r, a = ratio, advantages
    masked = mask <= 0
    # bucket + 2U, minus 2U for A > 0 and U for A < 0: the bin code without materialising any offset.
    code = _bucket(r, edges.tensor(r.dtype)).add_(2 * u)
    code = code.add_(a > 0, alpha=-2 * u).add_(a < 0, alpha=-u).masked_fill_(masked, 3 * u).reshape(-1)
    abs_a = a.abs() if weights is None else a.abs() * weights
    abs_ar = (r * abs_a).reshape(-1)  # = |A| r, since r >= 0 (NaN stays NaN)
    hist = torch.zeros(_ROWS, n_bins, dtype=torch.float64, device=r.device)
    _add_to_bins(hist[0], code, None)
    _add_to_bins(hist[1], code, abs_ar.double())
    if with_abs_a:
        _add_to_bins(hist[2], code, abs_a.double().expand(r.shape).reshape(-1))
    hist[1:, 3 * u] = 0.0  # masked tokens: whatever their values, keep them out of the collective
    # Masked tokens read as r = 1 (log r = 0); the caller subtracts their count from the sum of r.
    # A zero ratio is legal (log -> -inf): floor it so that only NaN/inf inputs read as non-finite.
    r_kept = r.masked_fill(masked, 1.0)
    log_r = torch.log(r_kept).clamp_min_(-100.0) if log_ratio is None else log_ratio.masked_fill(masked, 0.0)
    totals = torch.stack([r_kept.sum(dtype=torch.float64), log_r.sum(dtype=torch.float64)])
    return torch.cat([hist.reshape(-1), totals])


def _add_to_bins(row: torch.Tensor, code: torch.Tensor, values: torch.Tensor | None) -> None:
    """row[code[i]] += values[i] (1 where values is None) for a row of ~160 bins.

    On a GPU, bincount keeps the bins in each block's shared memory; index_add_ makes every token an
    atomic add on the same ~160 global addresses: the search on 16M tokens took 29.0 ms with it, 3.9 ms
    with bincount, on an H200 (bench/results/gpu_h200.md). bincount has no deterministic CUDA kernel:
    under torch.use_deterministic_algorithms index_add_ (which has one) is kept. index_add_ takes the
    int32 codes as they are."""
    if row.device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        row += torch.bincount(code, values, minlength=row.numel())
    elif values is None:
        row.index_add_(0, code, torch.ones((), dtype=row.dtype, device=row.device).expand(code.shape))
    else:
        row.index_add_(0, code, values)


def _suffix_sums(x: torch.Tensor) -> torch.Tensor:
    return torch.flip(torch.cumsum(torch.flip(x, [0]), 0), [0])


def _masses_on_grid(hist: torch.Tensor, edges: _Edges, measure: str):
    """P for every c_high and N for every c_low, from the reduced histograms (host side, tiny).

    value (Eq. 8):   P(h) = sum_{A>0} A min(r, h)          N(l) = sum_{A<0} |A| max(r, l)
    gradient:        P(h) = sum_{A>0, r<=h} A r            N(l) = sum_{A<0, r>=l, r<=c} |A| r
    The gradient measure counts only tokens whose surrogate still has a gradient (|d(rA)| = |A| r).
    """
    n_low, n_high, u = len(edges.low), len(edges.high), edges.n_bins
    grid_low = torch.tensor(edges.low, dtype=torch.float64)
    grid_high = torch.tensor(edges.high, dtype=torch.float64)
    count, abs_ar, abs_a = hist[0], hist[1], hist[2]

    # Positive tokens: c_high bucket k = #{c_high < r}, i.e. union bucket minus the n_low low edges.
    pos_bucket = (torch.arange(u) - n_low).clamp(0, n_high)
    pos = {name: torch.zeros(n_high + 1, dtype=torch.float64).index_add_(0, pos_bucket, h[:u])
           for name, h in (("count", count), ("ar", abs_ar), ("a", abs_a))}
    # Negative tokens: c_low bucket j = #{c_low <= r}; the bucket past the dual constant is kept apart.
    beyond_dual = u - 1 if edges.dual is not None else None
    neg_bucket = torch.arange(u).clamp(0, n_low)
    neg_keep = torch.ones(u, dtype=torch.float64)
    if beyond_dual is not None:
        neg_keep[beyond_dual] = 0.0
    neg = {name: torch.zeros(n_low + 1, dtype=torch.float64).index_add_(0, neg_bucket, h[u : 2 * u] * neg_keep)
           for name, h in (("count", count), ("ar", abs_ar), ("a", abs_a))}
    dual = {name: (h[u + beyond_dual] if beyond_dual is not None else torch.tensor(0.0, dtype=torch.float64))
            for name, h in (("count", count), ("ar", abs_ar), ("a", abs_a))}

    # Sums above a bucket are suffix sums, not total - prefix: a tiny mass must not cancel away.
    pos_ar_below = torch.cumsum(pos["ar"], 0)[:-1]  # r <= c_high[k]
    pos_a_above = _suffix_sums(pos["a"])[1:]  # r > c_high[k]
    neg_ar_above = _suffix_sums(neg["ar"])[1:]  # c_low[j] <= r (<= dual)
    neg_a_below = torch.cumsum(neg["a"], 0)[:-1]  # r < c_low[j]
    if measure == "value":
        p = pos_ar_below + grid_high * pos_a_above
        n = neg_ar_above + dual["ar"] + grid_low * neg_a_below
    else:
        p, n = pos_ar_below, neg_ar_above
    return p, n, pos["count"], neg["count"], dual["count"]


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
    log_ratio: torch.Tensor | None = None,
) -> ClipSearchResult:
    """Choose (c_low, c_high) for one update: BAPO's Algorithm 1, exactly, in one pass.

    Returns the bounds the sequential Algorithm 1 (order "paper") or the authors' loop (order
    "reference") would return: the first point of the search path whose positive share rho (Eq. 8,
    measured by `config.measure`) reaches rho0, or the path's last point (saturated bounds,
    target_met=False). Every grid point is evaluated from histograms built in one pass over the
    tokens; `all_reduce` is called exactly once (sum over the ranks of one optimizer step) and the
    host syncs once. The clip fractions, mean ratio and KL come out of the same histograms.

    ratio, advantages, mask: same shape (advantages may be per sequence, broadcastable); mask is 0/1.
    weights: optional per-token multipliers of the loss (importance-sampling correction); used in the
    measure in paper order (they scale each token's contribution), ignored in reference order (the
    authors' code applies them after the search).
    log_ratio: the clamped log-ratio behind `ratio`, if the caller has it (saves a log per token; it
    only feeds the KL metric).
    """
    ratio = ratio.detach()
    advantages = advantages.detach().to(ratio.dtype)
    if torch.broadcast_shapes(advantages.shape, ratio.shape) != ratio.shape:
        raise ValueError(f"advantages of shape {tuple(advantages.shape)} do not broadcast to the ratios' "
                         f"{tuple(ratio.shape)}")
    if weights is not None and config.order == "paper":
        weights = weights.detach().to(ratio.dtype)
    else:
        weights = None
    n_bad_local = None
    if config.nonfinite == "mask":
        bad = ~torch.isfinite(ratio * advantages) & (mask > 0)
        n_bad_local = bad.sum()
        mask = torch.where(bad, torch.zeros_like(mask), mask)
    edges = _edges(config)
    if log_ratio is not None:
        log_ratio = log_ratio.detach().to(ratio.dtype)
    packed = _token_statistics(ratio, advantages, mask, weights, edges, config.measure == "value", log_ratio)
    if n_bad_local is not None:
        packed = torch.cat([packed, n_bad_local.to(packed)[None]])
    if all_reduce is not None:
        packed = all_reduce(packed)
    packed = packed.cpu()  # the one host sync
    n_bad = int(packed[-1]) if n_bad_local is not None else 0
    u = edges.n_bins
    n_hist = _ROWS * (3 * u + 1)
    hist, totals = packed[:n_hist].reshape(_ROWS, -1), packed[n_hist : n_hist + 2]
    if not (bool(torch.isfinite(hist[:, : 3 * u]).all()) and bool(torch.isfinite(totals).all())):
        # Every rank sees the same reduced sums, so every rank raises (none is left in a collective).
        n_bad = int((~torch.isfinite(ratio * advantages) & (mask > 0)).sum())
        raise NonFiniteInputError(
            f"non-finite importance ratio or advantage on unmasked tokens ({n_bad} on this rank; every rank "
            "of the reduction raises). Check the log-probs and rewards upstream, or set bapo.nonfinite=mask "
            "to drop and count them."
        )
    p, n, pos_count, neg_count, dual_count = _masses_on_grid(hist, edges, config.measure)

    lows, highs = _search_path(config, len(edges.low), len(edges.high))
    p_path, n_path = p[torch.tensor(highs)], n[torch.tensor(lows)]
    rho_path = _share(p_path, n_path, config)
    if config.order == "reference":
        # The authors' test, verbatim: P / (N + eps) >= q, and N <= 0 counts as met (their `inf`).
        met = (n_path <= 0) | (p_path / (n_path + config.pn_eps) >= config.pn_target)
    else:
        met = rho_path >= (config.rho0 - _RHO_TOLERANCE)
    stop = int(torch.argmax(met.to(torch.int8))) if bool(met.any()) else len(lows) - 1
    j, i = lows[stop], highs[stop]

    n_pos, n_neg = float(pos_count.sum()), float(neg_count.sum()) + float(dual_count)
    num_tokens = float(hist[0, : 3 * u].sum())
    ratio_sum, log_ratio_sum = float(totals[0]) - float(hist[0, 3 * u]), float(totals[1])

    def frac(x: float, total: float) -> float:
        return x / total if total > 0 else 0.0

    return ClipSearchResult(
        c_low=edges.low[j],
        c_high=edges.high[i],
        rho=float(rho_path[stop]),
        rho_initial=float(rho_path[0]),
        target_met=bool(met[stop]),
        steps=stop,
        positive_mass=float(p_path[stop]),
        negative_mass=float(n_path[stop]),
        num_tokens=num_tokens,
        nonfinite_tokens=n_bad,
        tokens_pos=n_pos,
        tokens_neg=n_neg,
        clipfrac_pos=frac(float(pos_count[i + 1 :].sum()), n_pos),  # buckets past c_high[i]
        clipfrac_neg=frac(float(neg_count[: j + 1].sum()), n_neg),  # buckets below c_low[j]
        clipfrac_dual=frac(float(dual_count), n_neg),
        ratio_mean=frac(ratio_sum, num_tokens),
        approx_kl=frac(ratio_sum - num_tokens - log_ratio_sum, num_tokens),
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
    against; advantages [B, T] or [B, 1]; mask [B, T] (0/1). A log-ratio of +-inf is clamped to +-20
    like any other (that is what the clamp is for); NaN log-probs or advantages are non-finite tokens.
    Metrics (`bapo/...`) come from the search's histograms: global over `all_reduce`, and over the whole
    mini-batch when `bounds` comes from a per-step search.
    """
    # importance_ratio's two steps, keeping the clamped log-ratio: the search's KL metric reuses it.
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    if bounds is None:
        bounds = search_clip_bounds(ratio, advantages, mask, config, all_reduce, importance_weights, log_ratio)
    keep = mask > 0
    if config.nonfinite == "mask":
        # With "error" the search has already raised on any non-finite unmasked token.
        keep = keep & torch.isfinite(ratio.detach() * advantages)
    token_loss = clipped_surrogate(ratio, advantages, bounds.c_low, bounds.c_high, config.dual_clip)
    if importance_weights is not None:
        token_loss = token_loss * importance_weights
    # torch.where, not a product with the 0/1 mask: a NaN on a dropped token must not reach the sum.
    loss = torch.where(keep, token_loss, 0.0).sum() / global_num_tokens
    return loss, bounds.as_metrics()
