"""The fused CPU token pass (numba) against the PyTorch version of the same statistics.

Both compute [histograms | sum r | sum log r] for the bound search. The histograms must agree bit for bit
(same products in the ratios' dtype, same float64 accumulation in token order); the two sums only to
rounding (different summation order, and numba's log vs torch's).
"""

import math

import pytest
import torch

from bapo_nemo.algorithm import BAPOConfig, fused_cpu, search_clip_bounds
from bapo_nemo.algorithm import bapo as bapo_math

pytestmark = pytest.mark.skipif(not fused_cpu.available(), reason="numba is not installed")

CONFIGS = {
    "default": BAPOConfig(),
    "value+dual": BAPOConfig(measure="value", dual_clip=3.5),
    "reference": BAPOConfig.from_reference_recipe(),
}


def _batch(dtype, seed=0, per_sequence_advantages=True, b=64, t=97):
    g = torch.Generator().manual_seed(seed)
    log_ratio = (torch.randn(b, t, generator=g) * 0.4).to(dtype).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    adv = torch.randn(b, 1 if per_sequence_advantages else t, generator=g).to(dtype)
    adv[::7] = 0.0  # zero-advantage sequences have their own bins
    mask = (torch.rand(b, t, generator=g) > 0.15).to(dtype)
    # Exact ties with grid edges and the odd special value, on kept and on masked tokens.
    edges = bapo_math._edges(CONFIGS["default"]).tensor(dtype)
    ratio[0, : len(edges)] = edges
    ratio[1, : len(edges)] = torch.nextafter(edges, torch.full_like(edges, 9.0))
    ratio[2, :3] = torch.tensor([0.0, 1e-30, 1e30], dtype=dtype)
    mask[3, :] = 0.0
    ratio[3, :4] = torch.tensor([math.nan, math.inf, -math.nan, -0.0], dtype=dtype)  # masked: ignored
    return ratio, adv, mask, log_ratio


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("per_sequence", [True, False])
@pytest.mark.parametrize("with_weights", [False, True])
def test_fused_statistics_equal_the_pytorch_ones(dtype, name, per_sequence, with_weights):
    config = CONFIGS[name]
    ratio, adv, mask, _ = _batch(dtype, per_sequence_advantages=per_sequence)
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(ratio.shape, generator=g).to(dtype) if with_weights else None
    edges = bapo_math._edges(config)
    with_abs_a = config.measure == "value"
    fused = bapo_math._token_statistics(ratio, adv, mask, weights, edges, with_abs_a)
    eager = bapo_math._token_statistics_eager(ratio, adv, mask, weights, edges, with_abs_a)
    n_hist = 3 * (3 * edges.n_bins + 1)
    assert torch.equal(fused[:n_hist], eager[:n_hist])
    torch.testing.assert_close(fused[n_hist:], eager[n_hist:], rtol=1e-6, atol=1e-6)
    # and the token counts are the batch's: every token in exactly one bin
    assert fused[: 3 * edges.n_bins + 1].sum() == ratio.numel()


def test_a_given_log_ratio_feeds_the_kl_sum_like_the_log_of_the_ratio():
    ratio, adv, mask, log_ratio = _batch(torch.float32)
    ratio, mask = ratio[4:], mask[4:]  # rows without the hand-placed special values
    log_ratio, adv = log_ratio[4:], adv[4:]
    ratio = torch.exp(log_ratio)
    edges = bapo_math._edges(BAPOConfig())
    for stats in (bapo_math._token_statistics, bapo_math._token_statistics_eager):
        given = stats(ratio, adv, mask, None, edges, False, log_ratio)
        computed = stats(ratio, adv, mask, None, edges, False)
        expected = float((log_ratio * mask).double().sum())
        assert given[-1].item() == pytest.approx(expected, rel=1e-6)
        assert computed[-1].item() == pytest.approx(expected, rel=1e-5)


def test_nonfinite_kept_tokens_still_raise_through_the_fused_path():
    ratio, adv, mask, _ = _batch(torch.float32)
    ratio[5, 5], mask[5, 5], adv[5] = math.nan, 1.0, 1.0
    with pytest.raises(bapo_math.NonFiniteInputError, match=r"\(1 on this rank"):
        search_clip_bounds(ratio, adv, mask, BAPOConfig())


def test_unsupported_inputs_take_the_pytorch_path_with_the_same_bounds():
    # bfloat16 ratios have no bit-pattern table here: the eager path (widened to float32) serves them.
    ratio, adv, mask, _ = _batch(torch.float32)
    ratio, mask = ratio[4:], mask[4:]
    adv = adv[4:]
    low = search_clip_bounds(ratio.bfloat16(), adv.bfloat16(), mask, BAPOConfig())
    ref = search_clip_bounds(ratio.bfloat16().float(), adv.bfloat16().float(), mask, BAPOConfig())
    assert (low.c_low, low.c_high, low.steps) == (ref.c_low, ref.c_high, ref.steps)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_statistics_equal_the_cpu_ones(name, deterministic):
    """On a GPU the histograms come from bincount (index_add_ under deterministic algorithms): the counts
    exactly, the float64 sums to rounding (atomic adds land in any order)."""
    config = CONFIGS[name]
    ratio, adv, mask, _ = _batch(torch.float32)
    edges = bapo_math._edges(config)
    with_abs_a = config.measure == "value"
    cpu = bapo_math._token_statistics(ratio, adv, mask, None, edges, with_abs_a)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        cuda = bapo_math._token_statistics(ratio.cuda(), adv.cuda(), mask.cuda(), None, edges, with_abs_a).cpu()
    finally:
        torch.use_deterministic_algorithms(previous)
    n_bins = 3 * edges.n_bins + 1
    assert torch.equal(cuda[:n_bins], cpu[:n_bins])
    torch.testing.assert_close(cuda[n_bins:3 * n_bins], cpu[n_bins:3 * n_bins], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cuda[3 * n_bins:], cpu[3 * n_bins:], rtol=1e-6, atol=1e-6)  # CUDA's log
    on_gpu = search_clip_bounds(ratio.cuda(), adv.cuda(), mask.cuda(), config)
    on_cpu = search_clip_bounds(ratio, adv, mask, config)
    assert (on_gpu.c_low, on_gpu.c_high, on_gpu.steps) == (on_cpu.c_low, on_cpu.c_high, on_cpu.steps)
