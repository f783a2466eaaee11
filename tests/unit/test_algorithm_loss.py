"""BAPO loss: hand-computed values, gradients against autograd of a reference formula, micro-batch
additivity, metrics, non-finite handling, and config validation messages."""

from __future__ import annotations

import math
import re

import pytest
import torch

from bapo_nemo.algorithm import (
    BAPOConfig,
    BAPOConfigError,
    NonFiniteInputError,
    bapo_policy_loss,
    clipped_policy_loss,
    search_clip_bounds,
)


def _inputs(seed=0, b=6, t=40, scale=0.4):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
    mask = (torch.rand(b, t, generator=g) > 0.2).double()
    return logp, old, adv, mask


def reference_token_loss(logp, old, adv, c_low, c_high, dual=None):
    """The objective written out per token with Python floats (Algorithm 1, line 20 + dual clip)."""
    out = []
    for lp, o, a in zip(logp.tolist(), old.tolist(), adv.tolist()):
        r = math.exp(max(-20.0, min(20.0, lp - o)))
        surrogate = min(r * a, min(max(r, c_low), c_high) * a)
        loss = -surrogate
        if dual is not None and a < 0:
            loss = min(loss, -a * dual)
        out.append(loss)
    return out


def test_hand_computed_loss_value():
    # Two tokens, bounds [0.8, 1.2]:
    #  token 1: r = e^{ln 1.5} = 1.5, A = +2 -> min(3.0, 1.2*2 = 2.4) = 2.4 -> loss -2.4
    #  token 2: r = 0.5, A = -1            -> min(-0.5, 0.8*-1 = -0.8) = -0.8 -> loss 0.8
    # sum = -1.6, divided by a global count of 4 tokens -> -0.4
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    loss = clipped_policy_loss(logp, old, adv, torch.ones(1, 2), 4, c_low=0.8, c_high=1.2)
    assert float(loss) == pytest.approx(-0.4)
    # With dual clip c = 3 and token 2 at r = 4: loss = min(max(4, 0.8) * 1, 3 * 1) = 3 (capped).
    logp2 = torch.tensor([[math.log(1.5), math.log(4.0)]], dtype=torch.float64)
    loss = clipped_policy_loss(logp2, old, adv, torch.ones(1, 2), 2, c_low=0.8, c_high=1.2, dual_clip=3.0)
    assert float(loss) == pytest.approx((-2.4 + 3.0) / 2)


@pytest.mark.parametrize("dual", [None, 3.5])
def test_loss_and_gradient_match_reference_formula(dual):
    logp, old, adv, mask = _inputs(scale=0.8)
    cfg = BAPOConfig(dual_clip=dual)
    logp = logp.clone().requires_grad_(True)
    loss, metrics = bapo_policy_loss(logp, old, adv, mask, mask.sum(), cfg)
    loss.backward()
    c_low, c_high = metrics["bapo/c_low"], metrics["bapo/c_high"]

    # Reference: the per-token formula with the same bounds, differentiated by autograd token by token.
    ref_logp = logp.detach().clone().requires_grad_(True)
    r = torch.exp(torch.clamp(ref_logp - old, -20, 20))
    surrogate = torch.minimum(r * adv, torch.clamp(r, c_low, c_high) * adv)
    token_loss = -surrogate
    if dual is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * dual), token_loss)
    ref = (token_loss * mask).sum() / mask.sum()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(logp.grad, ref_logp.grad, atol=1e-14)
    # And the python-float transcription agrees on the value.
    flat = reference_token_loss(logp.detach().flatten(), old.flatten(), adv.flatten(), c_low, c_high, dual)
    assert loss.item() == pytest.approx(sum(v * w for v, w in zip(flat, mask.flatten().tolist())) / float(mask.sum()))
    # Hand check of the gradient sign: unclipped positive tokens push logp up (negative loss gradient).
    ratio = torch.exp(logp.detach() - old)
    free_pos = (adv > 0) & (ratio < c_high) & (mask > 0)
    assert bool((logp.grad[free_pos] < 0).all())
    clipped_pos = (adv > 0) & (ratio > c_high)
    assert bool((logp.grad[clipped_pos] == 0).all())


def test_microbatch_losses_add_up_to_batch_loss_with_shared_bounds():
    logp, old, adv, mask = _inputs(seed=3)
    cfg = BAPOConfig()
    n_tokens = mask.sum()
    bounds = search_clip_bounds(torch.exp(logp - old), adv, mask, cfg)
    full, _ = bapo_policy_loss(logp, old, adv, mask, n_tokens, cfg, bounds=bounds)
    parts = [
        bapo_policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], n_tokens, cfg, bounds=bounds)[0]
        for i in range(0, 6, 2)
    ]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-12)


def test_metrics_are_hand_computable():
    # Tokens (r, A): (1.5, +1), (1.1, +1), (0.5, -1), (1.0, -1); value measure, start [0.6, 1.2]:
    # P = 1.2 + 1.1 = 2.3, N = 0.6 + 1.0 = 1.6 -> rho = 2.3 / 3.9 = 0.59 >= 0.4: no search steps.
    # clipfrac_pos: 1 of 2 (r = 1.5 > 1.2); clipfrac_neg: 1 of 2 (r = 0.5 < 0.6).
    r = torch.tensor([[1.5, 1.1, 0.5, 1.0]], dtype=torch.float64)
    logp, old = torch.log(r), torch.zeros_like(r)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    _, m = bapo_policy_loss(logp, old, adv, torch.ones_like(r), 4, BAPOConfig(measure="value"))
    assert m["bapo/rho"] == pytest.approx(2.3 / 3.9) and m["bapo/steps"] == 0 and m["bapo/target_met"] == 1.0
    assert (m["bapo/clipfrac_pos"], m["bapo/clipfrac_neg"]) == (0.5, 0.5)
    assert m["bapo/ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 1.0) / 4)
    # k3 = (r - 1) - ln r, averaged (KL(old || new); the tokens were sampled from the old policy)
    k3 = sum(x - 1 - math.log(x) for x in [1.5, 1.1, 0.5, 1.0]) / 4
    assert m["bapo/approx_kl"] == pytest.approx(k3)


def test_nonfinite_logprobs_raise_or_mask():
    logp, old, adv, mask = _inputs(seed=1, b=2, t=5)
    logp, old, adv = logp.clone(), old.clone(), adv.clone()
    logp[0, 0] = math.nan
    adv[1, 2] = math.nan
    old[1, 3] = -math.inf  # log-ratio +inf: clamped to +20 like any stale token, not an error
    mask[0, 0] = mask[1, 2] = mask[1, 3] = 1.0
    with pytest.raises(NonFiniteInputError, match=r"\(2 on this rank"):
        bapo_policy_loss(logp, old, adv, mask, mask.sum(), BAPOConfig())
    loss, m = bapo_policy_loss(logp, old, adv, mask, mask.sum(), BAPOConfig(nonfinite="mask"))
    assert math.isfinite(float(loss)) and m["bapo/nonfinite_tokens"] == 2
    # Masking them by hand gives the same loss.
    clean_mask = mask.clone()
    clean_mask[0, 0] = clean_mask[1, 2] = 0
    logp_clean = torch.where(clean_mask > 0, logp, torch.zeros_like(logp))
    adv_clean = torch.where(clean_mask > 0, adv, torch.zeros_like(adv))
    ref, m_ref = bapo_policy_loss(logp_clean, old, adv_clean, clean_mask, mask.sum(), BAPOConfig(nonfinite="mask"))
    assert m_ref["bapo/nonfinite_tokens"] == 0 and m["bapo/num_tokens"] == m_ref["bapo/num_tokens"]
    assert float(loss) == pytest.approx(float(ref))


@pytest.mark.parametrize(
    "update, needle",
    [
        ({"rho0": 1.2}, "rho0"),
        ({"rho0": 0.0}, "rho0"),
        ({"c_low_step": 0}, "c_low_step"),
        ({"c_high_step": -0.05}, "c_high_step"),
        ({"c_low_min": 0.9, "c_low_max": 0.6}, "c_low_min=0.9, c_low_max=0.6"),
        ({"c_high_min": 0.9}, "c_high"),
        ({"order": "fastest"}, "order"),
        ({"measure": "loss"}, "'value' or 'gradient'"),
        ({"granularity": "epoch"}, "granularity"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"rho_0": 0.4}, "allowed keys"),
    ],
)
def test_invalid_config_names_the_field_and_allowed_values(update, needle):
    with pytest.raises(BAPOConfigError) as info:
        BAPOConfig.parse(update, where="loss_fn.bapo")
    # a field's error names the field (loss_fn.bapo.measure: ...), a cross-field one the block (loss_fn.bapo: ...)
    assert needle in str(info.value) and re.search(r"\n  loss_fn\.bapo[.:]", str(info.value))


def test_reference_recipe_maps_p_over_n_target_to_share():
    cfg = BAPOConfig.from_reference_recipe(adv_ratio_target=1.0)
    assert cfg.rho0 == 0.5 and cfg.pn_target == pytest.approx(1.0) and cfg.order == "reference"


@pytest.mark.parametrize("dual", [None, 2.0 + 1.5])
def test_histogram_metrics_equal_direct_token_counts(dual):
    logp, old, adv, mask = _inputs(seed=5, b=16, t=64, scale=0.9)
    cfg = BAPOConfig(dual_clip=dual)
    _, m = bapo_policy_loss(logp, old, adv, mask, mask.sum(), cfg)
    r = torch.exp(torch.clamp(logp - old, -20, 20))
    valid = mask > 0
    pos, neg = valid & (adv > 0), valid & (adv < 0)
    assert m["bapo/tokens_pos"] == int(pos.sum()) and m["bapo/tokens_neg"] == int(neg.sum())
    assert m["bapo/clipfrac_pos"] == pytest.approx(float((pos & (r > m["bapo/c_high"])).sum() / pos.sum()))
    assert m["bapo/clipfrac_neg"] == pytest.approx(float((neg & (r < m["bapo/c_low"])).sum() / neg.sum()))
    want_dual = float((neg & (r > dual)).sum() / neg.sum()) if dual else 0.0
    assert m["bapo/clipfrac_dual"] == pytest.approx(want_dual)
    if dual:
        assert want_dual > 0  # the data reach the dual-clip region, so the check is not vacuous
    assert m["bapo/ratio_mean"] == pytest.approx(float(r[valid].mean()))
    assert m["bapo/approx_kl"] == pytest.approx(float((r - 1 - torch.log(r))[valid].mean()))
