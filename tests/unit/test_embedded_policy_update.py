"""One optimizer step of the embedded trainer with a per-step bound search: keeping the micro-batches'
graphs until the bounds are known must give exactly the update of the extra-forward path, with half the
forwards. Real tiny Qwen2, real AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

from bapo_nemo.algorithm import BAPOConfig
from bapo_nemo.embedded.config.run_config import ModelConfig
from bapo_nemo.embedded.loop.grpo import TokenBatch, policy_update
from bapo_nemo.embedded.model.policy import build_model, token_logprobs_and_entropy
from bapo_nemo.embedded.model.tokenizer import load_tokenizer


def _stale_batch(model, n=12, seed=0) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 30, (n,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(3, 22, (n, width), generator=g)  # the shipped tokenizer has 22 tokens
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = ids * attention
    mask = attention[:, 1:].float()
    mask[:, :3] = 0.0  # prompt tokens
    with torch.no_grad():
        current, _ = token_logprobs_and_entropy(model, ids, attention, with_entropy=False)
    # Stale behaviour log-probs: ratios spread around 1, so the search moves and clipping happens.
    behavior = current + 0.5 * torch.randn(current.shape, generator=g)
    adv = torch.randn(n, 1, generator=g)
    return TokenBatch(ids, attention, mask, behavior, torch.ones_like(mask), torch.zeros_like(mask).long(),
                      adv, torch.zeros(n), torch.arange(n))


def test_kept_graphs_give_the_extra_forward_update_exactly_with_half_the_forwards():
    tokenizer = load_tokenizer()
    model_cfg = ModelConfig(hidden_size=64, intermediate_size=128, max_position_embeddings=128)
    base = build_model(model_cfg, tokenizer, seed=0)
    batch = _stale_batch(base)
    bapo = BAPOConfig(granularity="step", rho0=0.6)
    results = {}
    for name, graph_tokens in (("extra forward", 0), ("kept graphs", 10**6)):
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forwards = []
        model.register_forward_hook(lambda *_, calls=forwards: calls.append(1))
        metrics = policy_update(model, optimizer, batch, batch.behavior_logprobs, batch.loss_weights, bapo,
                                micro_batch_size=4, grad_clip=1.0, step_search_graph_tokens=graph_tokens)
        results[name] = (metrics, [p.detach().clone() for p in model.parameters()], len(forwards))

    (m_extra, p_extra, f_extra), (m_kept, p_kept, f_kept) = results["extra forward"], results["kept graphs"]
    assert m_extra["bapo/steps"] > 0  # the search moved: the bounds matter for this update
    assert m_kept == m_extra  # same bounds, loss, clip fractions, grad norm
    assert all(torch.equal(a, b) for a, b in zip(p_extra, p_kept))
    assert (f_extra, f_kept) == (6, 3)  # 12 sequences in micro-batches of 4: 3 no-grad + 3 grad forwards


def _lengths_batch(lengths: list[int]) -> TokenBatch:
    n, width = len(lengths), max(lengths)
    attention = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    zeros = torch.zeros(n, width - 1)
    return TokenBatch(attention * 5, attention, zeros, zeros, zeros, zeros.long(), torch.zeros(n, 1),
                      torch.zeros(n), torch.arange(n))


def test_micro_batches_cut_where_padding_outweighs_a_call():
    from bapo_nemo.embedded.loop.grpo import MICRO_BATCH_CALL_TOKENS, length_sorted_micro_batches

    assert MICRO_BATCH_CALL_TOKENS == 32  # the costs below are written for it
    # One long row among seven short ones: padding them to 60 costs 7 x 50 = 350 tokens; a second call 32.
    lengths = [10, 10, 60, 10, 10, 10, 10, 10]
    assert length_sorted_micro_batches(_lengths_batch(lengths), 8) == [[2], [0, 1, 3, 4, 5, 6, 7]]
    # Lengths 40 and 36: splitting saves 4 x 4 = 16 padded tokens, less than a call: one micro-batch.
    assert length_sorted_micro_batches(_lengths_batch([40] * 4 + [36] * 4), 8) == [list(range(8))]
    # micro_batch_size still caps the rows; every row appears exactly once.
    cuts = length_sorted_micro_batches(_lengths_batch([12] * 20), 8)
    assert max(len(c) for c in cuts) <= 8 and sorted(r for c in cuts for r in c) == list(range(20))
    assert len(cuts) == 3


def test_update_does_not_depend_on_how_rows_are_cut_into_micro_batches():
    """The loss is a token sum over the mini-batch divided by its token count, so cutting rows into
    micro-batches by length (trimmed to each one's longest row) gives the one-micro-batch update up to
    float rounding, while forwarding fewer padded tokens than fixed slices of the sorted rows."""
    tokenizer = load_tokenizer()
    model_cfg = ModelConfig(hidden_size=64, intermediate_size=128, max_position_embeddings=128)
    base = build_model(model_cfg, tokenizer, seed=0)
    batch = _stale_batch(base, n=16, seed=3)
    bapo = BAPOConfig(granularity="step", rho0=0.6)
    params, padded = {}, {}
    for micro_batch_size in (16, 8):
        model = copy.deepcopy(base)
        # SGD: the update is the gradient times the LR, so float rounding stays rounding. Adam's first step is
        # lr * sign(g) wherever |g| is far above its eps, and rounds differently near it: a parameter whose
        # gradient is ~1e-8 moved by a different ~1e-5 on another CPU's kernels.
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        shapes = []
        model.register_forward_hook(lambda _m, _a, kw, _o, seen=shapes: seen.append(kw["input_ids"].shape),
                                    with_kwargs=True)
        policy_update(model, optimizer, batch, batch.behavior_logprobs, batch.loss_weights, bapo,
                      micro_batch_size=micro_batch_size, grad_clip=1.0, step_search_graph_tokens=10**6)
        params[micro_batch_size] = [p.detach().clone() for p in model.parameters()]
        padded[micro_batch_size] = sum(rows * width for rows, width in shapes)
    for a, b in zip(params[16], params[8]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    lengths = sorted(batch.attention_mask.sum(-1).tolist(), reverse=True)
    fixed_slices = 8 * lengths[0] + 8 * lengths[8]  # what fixed slices of 8 sorted rows would forward
    assert sum(lengths) <= padded[8] < fixed_slices


def test_an_update_reports_its_whole_mini_batch_whether_searched_per_micro_batch_or_once():
    """Fixed bounds applied per micro-batch (loss_fn.bapo.enabled=false) and one step-wide search whose
    bounds stay at the same [0.8, 1.2] report what one search over the whole mini-batch reports, computed
    here before the update: the same token counts, masses, clip fractions and share rho = P / (P + N). So a
    fixed-clip run and a BAPO run count the same tokens. (Before, a step search's counts were added once per
    micro-batch, 3x here, and a fixed-clip share was the token-weighted mean of the micro-batches'.)"""
    from bapo_nemo.algorithm import importance_ratio, search_clip_bounds

    tokenizer = load_tokenizer()
    base = build_model(ModelConfig(hidden_size=64, intermediate_size=128, max_position_embeddings=128), tokenizer, 0)
    batch = _stale_batch(base, n=12, seed=5)
    fixed = BAPOConfig(enabled=False, c_low_min=0.8, c_high_min=1.2, granularity="microbatch")
    pinned = BAPOConfig(granularity="step", c_low_min=0.8, c_low_max=0.8, c_high_min=1.2, c_high_max=1.2)
    with torch.no_grad():
        current, _ = token_logprobs_and_entropy(base, batch.input_ids, batch.attention_mask, with_entropy=False)
    ratio = importance_ratio(current, batch.behavior_logprobs)
    whole = search_clip_bounds(ratio, batch.advantages.expand_as(ratio), batch.mask, fixed)
    assert whole.tokens_pos > 0 and whole.tokens_neg > 0 and 0 < whole.clipfrac_pos and 0 < whole.clipfrac_neg
    for bapo in (fixed, pinned):
        model = copy.deepcopy(base)
        metrics = policy_update(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch,
                                batch.behavior_logprobs, batch.loss_weights, bapo, micro_batch_size=4,
                                grad_clip=1.0, step_search_graph_tokens=10**6)
        for key in ("num_tokens", "tokens_pos", "tokens_neg"):
            assert metrics[f"bapo/{key}"] == getattr(whole, key), (bapo.granularity, key)
        for key in ("positive_mass", "negative_mass", "clipfrac_pos", "clipfrac_neg", "rho", "rho_initial"):
            assert metrics[f"bapo/{key}"] == pytest.approx(getattr(whole, key), rel=1e-5), (bapo.granularity, key)
