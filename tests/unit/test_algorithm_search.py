"""BAPO bound search: hand-computed cases, equivalence with the sequential Algorithm 1 and with a
transcription of the authors' loop, monotonicity properties, and edge cases."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bapo_nemo.algorithm import BAPOConfig, NonFiniteInputError, search_clip_bounds

# ------------------------------------------------------------------------------------------------
# Independent sequential references (written from the paper / the authors' code, token by token)
# ------------------------------------------------------------------------------------------------


def masses(r, a, m, c_low, c_high, measure, dual_clip=None):
    """P and N straight from their definitions, float64, no histograms."""
    r, a, m = r.double(), a.double(), m.double()
    pos, neg = (a > 0) & (m > 0), (a < 0) & (m > 0)
    if measure == "value":  # Eq. 8
        p = (a * torch.clamp(r, max=c_high) * m)[pos].sum()
        n = (a.abs() * torch.clamp(r, min=c_low) * m)[neg].sum()
    else:  # tokens that still carry gradient
        keep_pos = pos & (r <= c_high)
        keep_neg = neg & (r >= c_low)
        if dual_clip is not None:
            keep_neg &= r <= dual_clip
        p = (a * r * m)[keep_pos].sum()
        n = (a.abs() * r * m)[keep_neg].sum()
    return float(p), float(n)


def share(p, n):
    return 1.0 if n == 0 else p / (p + n)


def sequential_paper(r, a, m, cfg: BAPOConfig):
    """Algorithm 1 as printed, with integer step counters: one evaluation per iteration."""
    n_low = math.floor((cfg.c_low_max - cfg.c_low_min) / cfg.c_low_step + 1e-9)
    n_high = math.floor((cfg.c_high_max - cfg.c_high_min) / cfg.c_high_step + 1e-9)
    i = j = steps = 0

    def rho_at(i, j):
        return share(*masses(r, a, m, cfg.c_low_min + j * cfg.c_low_step, cfg.c_high_min + i * cfg.c_high_step,
                             cfg.measure, cfg.dual_clip))

    rho = rho_at(i, j)
    while rho < cfg.rho0 - 1e-12 and j + 1 <= n_low:  # c_low + d2 <= b-
        if i + 1 <= n_high:  # c_high + d1 <= b+
            i += 1
        else:
            j += 1
        steps += 1
        rho = rho_at(i, j)
    return cfg.c_low_min + j * cfg.c_low_step, cfg.c_high_min + i * cfg.c_high_step, rho, steps


def authors_loop(r, a, m, q, low, low_max, low_step, high, high_max, high_step, eps, measure="value", dual=None):
    """Transcription of recipe/bapo/policy_loss.py (WooooDyy/BAPO): float accumulation, P/N vs q."""

    def pn(lo, hi):
        p, n = masses(r, a, m, lo, hi, measure, dual)
        return math.inf if n <= 0 else p / (n + eps)

    ratio = pn(low, high)
    steps = 0
    while ratio < q and low < low_max:
        low = min(low + low_step, low_max)
        steps += 1
        ratio = pn(low, high)
        if ratio >= q:
            break
    while ratio < q and high < high_max:
        high = min(high + high_step, high_max)
        steps += 1
        ratio = pn(low, high)
        if ratio >= q:
            break
    return low, high, ratio, steps


def tokens(values):
    return torch.tensor(values, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# Grid
# ------------------------------------------------------------------------------------------------


def test_paper_grid_reaches_both_ends_without_float_drift():
    cfg = BAPOConfig()
    # (0.9 - 0.6) / 0.02 = 15 steps -> 16 points; naive accumulation of 0.02 stops at 0.88.
    assert len(cfg.c_low_grid()) == 16 and cfg.c_low_grid()[-1] == 0.9
    # (3.0 - 1.2) / 0.05 = 36 steps -> 37 points.
    assert len(cfg.c_high_grid()) == 37 and cfg.c_high_grid()[-1] == 3.0
    acc = 0.6
    while acc + 0.02 <= 0.9:
        acc += 0.02
    assert acc < 0.89  # the float drift the integer grid avoids


def test_reference_grid_clamps_last_step_to_max():
    cfg = BAPOConfig(order="reference", c_low_min=0.6, c_low_max=0.75, c_low_step=0.1, measure="value")
    # min(0.6 + 0.1, 0.75) = 0.7, then min(0.8, 0.75) = 0.75: the authors' clamp.
    assert cfg.c_low_grid() == [0.6, 0.7, 0.75]


# ------------------------------------------------------------------------------------------------
# Hand-computed cases
# ------------------------------------------------------------------------------------------------


def test_hand_computed_paper_value_measure_meets_target_by_raising_c_high():
    # Tokens (r, A): (1.5, +1), (1.0, -1), (1.0, -1).
    # value measure at [0.6, 1.2]: P = 1*min(1.5, 1.2) = 1.2; N = 1*max(1,0.6) + 1*max(1,0.6) = 2
    #   rho = 1.2 / 3.2 = 0.375 < 0.4  -> raise c_high.
    # at c_high = 1.25: P = 1.25, rho = 1.25 / 3.25 = 0.3846 < 0.4
    # at c_high = 1.30: P = 1.30, rho = 1.30 / 3.30 = 0.3939 < 0.4
    # at c_high = 1.35: P = 1.35, rho = 1.35 / 3.35 = 0.4030 >= 0.4 -> stop after 3 steps.
    r, a, m = tokens([1.5, 1.0, 1.0]), tokens([1, -1, -1]), torch.ones(3)
    res = search_clip_bounds(r, a, m, BAPOConfig(measure="value"))
    assert (res.c_low, res.c_high, res.steps, res.target_met) == (0.6, 1.35, 3, True)
    assert res.rho == pytest.approx(1.35 / 3.35)
    assert res.rho_initial == pytest.approx(1.2 / 3.2)
    assert (res.positive_mass, res.negative_mass) == pytest.approx((1.35, 2.0))


def test_hand_computed_gradient_measure_raises_c_low_to_filter_negatives():
    # Tokens (r, A): (1.0, +1), (0.7, -1), (1.0, -1), (1.0, -1).  c_high range pinned at 1.2 (one point).
    # gradient measure at c_low = 0.6: P = 1.0; N = 0.7 + 1 + 1 = 2.7; rho = 1 / 3.7 = 0.270 < 0.4
    # c_low climbs 0.62, 0.64, ..., 0.70: r = 0.7 is still >= c_low at 0.70 (not clipped) -> N = 2.7
    # at c_low = 0.72 the 0.7 token is clipped: N = 2.0, rho = 1 / 3 = 0.333 < 0.4 -> saturate at 0.9,
    # which clips nothing more; target unreachable: saturated bounds and target_met False.
    cfg = BAPOConfig(measure="gradient", c_high_min=1.2, c_high_max=1.2)
    r, a, m = tokens([1.0, 0.7, 1.0, 1.0]), tokens([1, -1, -1, -1]), torch.ones(4)
    res = search_clip_bounds(r, a, m, cfg)
    assert (res.c_low, res.c_high, res.target_met, res.steps) == (0.9, 1.2, False, 15)
    assert res.rho == pytest.approx(1 / 3)
    assert res.rho_initial == pytest.approx(1 / 3.7)
    # Lower the target to 0.3: met at the first c_low that clips the 0.7 token, 0.72 = 0.6 + 6 * 0.02.
    res = search_clip_bounds(r, a, m, cfg.model_copy(update={"rho0": 0.3}))
    assert (res.c_low, res.steps, res.target_met) == (pytest.approx(0.72), 6, True)


def test_hand_computed_reference_order_compares_p_over_n():
    # Authors' recipe defaults: q = adv_ratio_target = 1 (share 0.5); c_low 0.6 -> 0.8 step 0.05;
    # c_high 1.2 -> 2.0 step 0.05; value measure.
    # Tokens (r, A): (1.6, +1), (0.5, -1), (1.0, -1):
    #   start [0.6, 1.2]: P = 1.2; N = max(0.5,0.6) + 1 = 1.6 -> P/N = 0.75 < 1
    #   c_low rises first (and only raises N): 0.65 -> N 1.65, ..., 0.8 -> N = 1.8, P/N = 0.667
    #   then c_high: P/N >= 1 needs P >= 1.8: c_high = 1.6 gives P = min(1.6, 1.6) = 1.6 < 1.8; r caps P at 1.6
    #   so c_high climbs to 2.0 with P/N = 1.6 / 1.8: unmet, saturated at [0.8, 2.0] after 4 + 16 = 20 steps.
    cfg = BAPOConfig.from_reference_recipe()
    r, a, m = tokens([1.6, 0.5, 1.0]), tokens([1, -1, -1]), torch.ones(3)
    res = search_clip_bounds(r, a, m, cfg)
    assert (res.c_low, res.c_high, res.target_met, res.steps) == (0.8, 2.0, False, 20)
    q = (1.6 / (1.8 + 1e-8))
    assert res.rho == pytest.approx(q / (1 + q))


# ------------------------------------------------------------------------------------------------
# Equivalence with the sequential algorithms on random inputs
# ------------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    n = draw(st.integers(1, 60))
    log_r = draw(st.lists(st.floats(-2.5, 2.5, allow_nan=False), min_size=n, max_size=n))
    adv = draw(st.lists(st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5]) | st.floats(-3, 3), min_size=n, max_size=n))
    mask = draw(st.lists(st.sampled_from([0.0, 1.0, 1.0, 1.0]), min_size=n, max_size=n))
    return torch.tensor(log_r, dtype=torch.float64).exp(), tokens(adv), tokens(mask)


@settings(max_examples=150, deadline=None)
@given(batch=batches(), measure=st.sampled_from(["value", "gradient"]), rho0=st.floats(0.05, 0.95),
       dual=st.sampled_from([None, 3.5]))
def test_paper_order_equals_sequential_algorithm_1(batch, measure, rho0, dual):
    r, a, m = batch
    cfg = BAPOConfig(measure=measure, rho0=rho0, dual_clip=dual)
    res = search_clip_bounds(r, a, m, cfg)
    c_low, c_high, rho, steps = sequential_paper(r, a, m, cfg)
    assert res.c_low == pytest.approx(c_low, abs=1e-12)
    assert res.c_high == pytest.approx(c_high, abs=1e-12)
    assert res.steps == steps
    assert res.rho == pytest.approx(rho, rel=1e-9, abs=1e-12)
    assert res.target_met == (rho >= rho0 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(batch=batches(), measure=st.sampled_from(["value", "gradient"]), q=st.floats(0.1, 3.0),
       lows=st.sampled_from([(0.6, 0.8, 0.05), (0.8, 0.95, 0.05), (0.6, 0.75, 0.1)]),
       highs=st.sampled_from([(1.2, 2.0, 0.05), (1.2, 2.0, 0.1), (1.28, 1.5, 0.1)]))
def test_reference_order_equals_authors_loop(batch, measure, q, lows, highs):
    r, a, m = batch
    cfg = BAPOConfig.from_reference_recipe(
        adv_ratio_target=q, ratio_lower_start=lows[0], ratio_lower_max=lows[1], ratio_lower_step=lows[2],
        ratio_upper_start=highs[0], ratio_upper_max=highs[1], ratio_upper_step=highs[2], clip_ratio_c=None,
        measure=measure,
    )
    res = search_clip_bounds(r, a, m, cfg)
    low, high, pn, steps = authors_loop(r, a, m, q, *lows, *highs, eps=1e-8, measure=measure)
    # The authors' float accumulation drifts by ~1e-16 per step; decisions are the same.
    assert res.c_low == pytest.approx(low, abs=1e-9)
    assert res.c_high == pytest.approx(high, abs=1e-9)
    assert res.steps == steps
    assert res.target_met == (pn >= q)


# ------------------------------------------------------------------------------------------------
# Monotonicity (the reason the gradient measure is the default)
# ------------------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(batch=batches())
def test_gradient_share_never_decreases_when_either_bound_rises(batch):
    r, a, m = batch
    cfg = BAPOConfig()
    for hi in cfg.c_high_grid()[::6]:
        shares = [share(*masses(r, a, m, lo, hi, "gradient")) for lo in cfg.c_low_grid()]
        assert all(b >= x - 1e-12 for x, b in itertools.pairwise(shares))
    for lo in cfg.c_low_grid()[::5]:
        shares = [share(*masses(r, a, m, lo, hi, "gradient")) for hi in cfg.c_high_grid()]
        assert all(b >= x - 1e-12 for x, b in itertools.pairwise(shares))


@settings(max_examples=100, deadline=None)
@given(batch=batches())
def test_value_share_never_rises_with_c_low(batch):
    r, a, m = batch
    cfg = BAPOConfig()
    for hi in cfg.c_high_grid()[::6]:
        shares = [share(*masses(r, a, m, lo, hi, "value")) for lo in cfg.c_low_grid()]
        assert all(b <= x + 1e-12 for x, b in itertools.pairwise(shares))


# ------------------------------------------------------------------------------------------------
# Edge cases
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("measure", ["value", "gradient"])
def test_no_negative_tokens_keeps_starting_bounds(measure):
    # N = 0: rho = 1 (nothing to balance), met at once.
    res = search_clip_bounds(tokens([1.5, 0.9]), tokens([1.0, 2.0]), torch.ones(2), BAPOConfig(measure=measure))
    assert (res.c_low, res.c_high, res.rho, res.target_met, res.steps) == (0.6, 1.2, 1.0, True, 0)


@pytest.mark.parametrize("measure", ["value", "gradient"])
def test_no_positive_tokens_saturates_unmet(measure):
    # P = 0 at every bound: rho = 0 < 0.4, the whole path is walked: 36 c_high steps + 15 c_low steps.
    res = search_clip_bounds(tokens([1.0, 0.5]), tokens([-1.0, -2.0]), torch.ones(2), BAPOConfig(measure=measure))
    assert (res.c_low, res.c_high, res.rho, res.target_met, res.steps) == (0.9, 3.0, 0.0, False, 51)


def test_all_masked_and_all_zero_advantages_keep_starting_bounds():
    cfg = BAPOConfig()
    res = search_clip_bounds(tokens([1.5, 0.5]), tokens([1.0, -1.0]), torch.zeros(2), cfg)
    assert (res.c_low, res.c_high, res.target_met, res.num_tokens) == (0.6, 1.2, True, 0.0)
    res = search_clip_bounds(tokens([1.5, 0.5]), tokens([0.0, 0.0]), torch.ones(2), cfg)
    assert (res.c_low, res.c_high, res.target_met, res.num_tokens) == (0.6, 1.2, True, 2.0)


def test_disabled_uses_fixed_bounds_but_still_reports_rho():
    # clip-higher baseline [0.8, 1.28]; tokens (1.5, +1), (1.0, -1): value P = 1.28, N = 1 -> rho = 1.28 / 2.28
    cfg = BAPOConfig(enabled=False, c_low_min=0.8, c_high_min=1.28, measure="value")
    res = search_clip_bounds(tokens([1.5, 1.0]), tokens([1.0, -1.0]), torch.ones(2), cfg)
    assert (res.c_low, res.c_high, res.steps) == (0.8, 1.28, 0)
    assert res.rho == pytest.approx(1.28 / 2.28)


def test_single_point_c_low_grid_never_moves_as_in_algorithm_1():
    # Algorithm 1's loop needs c_low + d2 <= b-: with a one-point c_low grid it never runs, even if
    # c_high could still rise.
    cfg = BAPOConfig(c_low_min=0.8, c_low_max=0.8, measure="value")
    res = search_clip_bounds(tokens([2.0, 1.0]), tokens([1.0, -5.0]), torch.ones(2), cfg)
    assert (res.c_low, res.c_high, res.steps, res.target_met) == (0.8, 1.2, 0, False)


def test_nonfinite_inputs_raise_with_count_or_are_masked_and_counted():
    r, a, m = tokens([1.0, math.nan, 1.2, 1.0]), tokens([1.0, 1.0, math.inf, -1.0]), torch.ones(4)
    with pytest.raises(NonFiniteInputError, match=r"\(2 on this rank"):
        search_clip_bounds(r, a, m, BAPOConfig())
    # A bad value on a masked token is ignored.
    m_masked = tokens([1.0, 0.0, 0.0, 1.0])
    assert search_clip_bounds(r, a, m_masked, BAPOConfig()).nonfinite_tokens == 0
    res = search_clip_bounds(r, a, m, BAPOConfig(nonfinite="mask", measure="value"))
    # Remaining tokens (1.0, +1), (1.0, -1): rho = 1 / 2.
    assert res.nonfinite_tokens == 2 and res.num_tokens == 2 and res.rho == pytest.approx(0.5)


def test_per_sequence_advantages_broadcast():
    r = tokens([[1.5, 1.0], [1.0, 1.0]])
    a = tokens([[1.0], [-1.0]])
    res = search_clip_bounds(r, a, torch.ones(2, 2), BAPOConfig(measure="value"))
    full = search_clip_bounds(r, a.expand(2, 2), torch.ones(2, 2), BAPOConfig(measure="value"))
    assert (res.c_low, res.c_high, res.rho) == (full.c_low, full.c_high, full.rho)


def test_all_reduce_is_called_exactly_once():
    calls = []

    def counting_sum(t):
        calls.append(t.numel())
        return t

    search_clip_bounds(torch.rand(100) + 0.5, torch.randn(100), torch.ones(100), BAPOConfig(), counting_sum)
    # one call carrying every histogram: edges = 16 c_low + 37 c_high = 53 -> 54 buckets;
    # bins = 3 * 54 (positive, negative, zero advantage) + 1 (masked) = 163; 3 statistics per bin, plus
    # the sums of r and log r -> 3 * 163 + 2 = 491 numbers
    assert calls == [491]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "config",
    [BAPOConfig(), BAPOConfig(dual_clip=3.5),
     BAPOConfig.from_reference_recipe(ratio_lower_start=0.8, ratio_lower_max=0.95, ratio_upper_step=0.1)],
)
def test_table_lookup_buckets_equal_binary_search_at_and_around_every_edge(dtype, config):
    from bapo_nemo.algorithm.bapo import _bucket, _edges

    edges = _edges(config).tensor(dtype)
    up, down = torch.full_like(edges, 9.0), torch.full_like(edges, -9.0)
    r = torch.cat([
        torch.exp(torch.randn(20000, generator=torch.Generator().manual_seed(0))).to(dtype),
        edges, torch.nextafter(edges, up), torch.nextafter(edges, down),  # exact ties and one float off
        torch.tensor([0.0, 1e-30, 1e30], dtype=dtype),
    ])
    assert torch.equal(_bucket(r, edges), torch.searchsorted(edges, r))


def test_a_tiny_negative_mass_is_not_cancelled_away():
    # Found by hypothesis: unmasked tokens (r, A) = (0.368, -2) and (1.0, -1.4e-273). At c_low = 0.6 the
    # first is clipped, so N = 1.4e-273 > 0 and P = 0: rho = 0, the target is unmet and the search must
    # climb. Computing N as total - prefix gives 0.7358 - 0.7358 = 0 and a wrong "met at once".
    r = tokens([math.exp(-1.0), 1.0])
    a = tokens([-2.0, -1.4302e-273])
    res = search_clip_bounds(r, a, torch.ones(2), BAPOConfig(measure="gradient"))
    assert res.negative_mass > 0 and res.rho == 0.0 and not res.target_met and res.steps == 51
