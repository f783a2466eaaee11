"""BAPOLossFn against NeMo-RL v0.7.0's real ClippedPGLossFn (CPU tensors).

Needs nemo_rl importable (marked `nemo_rl`; skips in CI). Nothing is faked: both losses are the real
classes, called the way NeMo-RL's workers call them (next_token_logprobs [B, S-1], a BatchedDataDict
with [B, S] tensors, global_valid_seqs/toks)."""

from __future__ import annotations

import math

import pytest
import torch

B, S = 4, 9


def _batch(seed: int = 0, behavior_gap: float = 0.3):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(B, S, generator=g, dtype=torch.float64) * 2 - 0.1
    prev = gen + behavior_gap * torch.randn(B, S, generator=g, dtype=torch.float64)
    token_mask = torch.ones(B, S, dtype=torch.float64)
    token_mask[:, 0] = 0  # prompt token
    token_mask[1, 6:] = 0  # a shorter response
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone()
    data = BatchedDataDict(
        {
            "token_mask": token_mask,
            "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64),
            "advantages": adv,
            "prev_logprobs": prev,
            "generation_logprobs": gen,
            "reference_policy_logprobs": prev - 0.05,
        }
    )
    curr = (prev[:, 1:] + 0.4 * torch.randn(B, S - 1, generator=g, dtype=torch.float64)).requires_grad_(True)
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    return data, curr, torch.tensor(float(data["sample_mask"].sum())), mask.sum()


def _loss_cfg(**over):
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig

    base = {
        "reference_policy_kl_penalty": 0.01,
        "ratio_clip_min": 0.2,
        "ratio_clip_max": 0.28,
        "ratio_clip_c": None,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 2.0,
    }
    base.update(over)
    return ClippedPGLossConfig(**base)


def _run(fn, curr, data, seqs, toks):
    c = curr.detach().clone().requires_grad_(True)
    loss, metrics = fn(c, data, seqs, toks)
    loss.backward()
    return loss.detach(), c.grad, metrics


@pytest.mark.parametrize("bapo_block", [{"bapo": {"enabled": False}}, {}], ids=["disabled", "absent"])
def test_disabled_or_absent_is_exactly_clipped_pg_loss(bapo_block):
    """bapo.enabled=false, or no loss_fn.bapo block (what the driver announces as plain GRPO): loss, gradient
    and every metric equal the parent's (same loss_fn config)."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn

    from bapo_nemo.nemo.loss import BAPOLossFn

    data, curr, seqs, toks = _batch()
    ref = _run(ClippedPGLossFn(_loss_cfg()), curr, data, seqs, toks)
    ours = _run(BAPOLossFn(_loss_cfg(**bapo_block)), curr, data, seqs, toks)
    assert torch.equal(ref[0], ours[0])
    assert torch.equal(ref[1], ours[1])
    assert ref[2] == ours[2]


def test_degenerate_range_equals_parent_with_same_bounds():
    """Proximal reference, c_low fixed at 0.8 and c_high at 1.28: the bounds the parent's epsilons 0.2/0.28
    give, so loss and gradient match ClippedPGLossFn exactly and its metrics are a subset of ours."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn

    from bapo_nemo.nemo.loss import BAPOLossFn

    data, curr, seqs, toks = _batch(1)
    ref = _run(ClippedPGLossFn(_loss_cfg()), curr, data, seqs, toks)
    bapo = {
        "ratio_reference": "proximal",
        "c_low_min": 0.8,
        "c_low_max": 0.8,
        "c_high_min": 1.28,
        "c_high_max": 1.28,
    }
    ours = _run(BAPOLossFn(_loss_cfg(bapo=bapo)), curr, data, seqs, toks)
    torch.testing.assert_close(ref[0], ours[0], rtol=0, atol=1e-15)
    torch.testing.assert_close(ref[1], ours[1], rtol=0, atol=1e-15)
    for k, v in ref[2].items():
        assert ours[2][k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    # one micro-batch holding every valid token: the token-weighted bound is the bound itself
    assert ours[2]["bapo/c_low"] == pytest.approx(0.8)
    assert ours[2]["bapo/c_high"] == pytest.approx(1.28)


def test_searched_bounds_reach_the_parent_and_are_restored():
    """The parent's loss at BAPO's bounds equals ClippedPGLossFn configured with those bounds as epsilons;
    the loss object keeps its configured epsilons between calls (stateless for pickling)."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn

    from bapo_nemo.algorithm import BAPOConfig, search_clip_bounds
    from bapo_nemo.algorithm.bapo import importance_ratio
    from bapo_nemo.nemo.loss import BAPOLossFn

    data, curr, seqs, toks = _batch(2, behavior_gap=0.6)
    fn = BAPOLossFn(_loss_cfg(bapo={"ratio_reference": "behavior"}))
    loss, grad, metrics = _run(fn, curr, data, seqs, toks)
    assert (fn.ratio_clip_min, fn.ratio_clip_max) == (0.2, 0.28)

    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    expected = search_clip_bounds(
        importance_ratio(curr.detach(), data["generation_logprobs"][:, 1:]),
        data["advantages"][:, 1:],
        mask,
        BAPOConfig(),
    )
    assert metrics["bapo/c_low"] == pytest.approx(expected.c_low)
    assert metrics["bapo/c_high"] == pytest.approx(expected.c_high)

    # behaviour reference == parent run on data whose prev_logprobs are the behaviour log-probs
    parent_data = data.__class__({**data, "prev_logprobs": data["generation_logprobs"]})
    parent = ClippedPGLossFn(_loss_cfg(ratio_clip_min=1 - expected.c_low, ratio_clip_max=expected.c_high - 1))
    ref = _run(parent, curr, parent_data, seqs, toks)
    torch.testing.assert_close(loss, ref[0], rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, ref[1], rtol=0, atol=1e-15)
    assert metrics["sampling_importance_ratio"] == pytest.approx(1.0, abs=1e-6)  # exp(gen - gen) = 1
    assert metrics["bapo/behavior_kl"] > 0


def test_loss_fn_pickles_and_micro_batches_add_up():
    """Pickled like Ray does; two micro-batch calls with the global token count give the full-batch
    metrics once aggregated the NeMo-RL way (token-weighted bounds)."""
    import pickle

    from bapo_nemo.nemo.loss import BAPOLossFn
    from tests.support.nemo_metrics import aggregate_like_nemo

    data, curr, seqs, toks = _batch(3)
    fn = pickle.loads(pickle.dumps(BAPOLossFn(_loss_cfg(bapo={"ratio_reference": "behavior"}))))
    halves = [data.slice(0, 2), data.slice(2, 4)]
    mb_metrics = []
    for i, half in enumerate(halves):
        _, m = fn(curr[2 * i : 2 * i + 2].detach(), half, seqs, toks)
        mb_metrics.append(m)
    agg = aggregate_like_nemo([[mb_metrics]])
    n0 = float((halves[0]["token_mask"][:, 1:] * halves[0]["sample_mask"].unsqueeze(-1)).sum())
    n1 = float((halves[1]["token_mask"][:, 1:] * halves[1]["sample_mask"].unsqueeze(-1)).sum())
    c0, c1 = mb_metrics[0]["bapo/c_low"] * float(toks) / n0, mb_metrics[1]["bapo/c_low"] * float(toks) / n1
    assert agg["bapo/c_low"] == pytest.approx((c0 * n0 + c1 * n1) / (n0 + n1))
    # every advantage is non-zero (Gaussian draws), so positive + negative shares cover all tokens
    assert math.isclose(agg["bapo/pos_token_frac"] + agg["bapo/neg_token_frac"], 1.0, abs_tol=1e-12)


def test_invalid_combinations_name_the_keys():
    from bapo_nemo.nemo.loss import BAPOLossFn

    with pytest.raises(ValueError, match="loss_fn.force_on_policy_ratio"):
        BAPOLossFn(_loss_cfg(force_on_policy_ratio=True, bapo={}))
    with pytest.raises(ValueError, match="loss_fn.bapo.ratio_reference"):
        BAPOLossFn(_loss_cfg(bapo={"ratio_reference": "current"}))
    with pytest.raises(ValueError, match="loss_fn.bapo.rho0"):
        BAPOLossFn(_loss_cfg(bapo={"rho0": 1.5}))


def test_step_granularity_bounds_travel_in_the_batch():
    """granularity: step -> the loss uses the bounds the driver attached to the batch, not a new search,
    and its loss equals ClippedPGLossFn at those bounds."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn

    from bapo_nemo.nemo.loss import BAPOLossFn
    from bapo_nemo.nemo.step_bounds import attach_bounds, search_result

    data, curr, seqs, toks = _batch(4)
    attach_bounds(
        data, search_result(c_low=0.7, c_high=2.05, rho=0.4, rho_initial=0.1, target_met=True, steps=18)
    )
    fn = BAPOLossFn(_loss_cfg(bapo={"granularity": "step", "ratio_reference": "proximal"}))
    loss, grad, metrics = _run(fn, curr, data, seqs, toks)
    assert metrics["bapo/c_low"] == pytest.approx(0.7) and metrics["bapo/c_high"] == pytest.approx(2.05)
    ref = _run(ClippedPGLossFn(_loss_cfg(ratio_clip_min=0.3, ratio_clip_max=1.05)), curr, data, seqs, toks)
    torch.testing.assert_close(loss, ref[0], rtol=0, atol=1e-15)
    torch.testing.assert_close(grad, ref[1], rtol=0, atol=1e-15)


def test_driver_builds_the_loss_from_master_config_sections():
    """The driver's make_loss_fn and its step-bounds layer on a MasterConfig-shaped object (sections as
    v0.7.0 gives them: policy a dict, loss_fn a ClippedPGLossConfig); the policy is a stand-in for NeMo-RL's
    Ray-backed Policy, which needs GPUs."""
    from types import SimpleNamespace

    from bapo_nemo.nemo.driver import make_loss_fn
    from bapo_nemo.nemo.layers import AFTER_SETUP, Run, install_layers, layer
    from bapo_nemo.nemo.step_bounds import StepBoundsTrainer

    policy_cfg = {
        "dtensor_cfg": {"enabled": True, "tensor_parallel_size": 2, "context_parallel_size": 2},
        "train_global_batch_size": 64,
    }
    mc = SimpleNamespace(
        policy=policy_cfg,
        loss_fn=_loss_cfg(bapo={"granularity": "step"}),
        grpo={"num_generations_per_prompt": 16, "seed": 3},
    )
    fn = make_loss_fn(mc)
    assert (fn.dtensor_tp, fn.dtensor_cp) == (2, 2)

    def with_step_bounds(loss_fn):
        policy = SimpleNamespace(train=lambda *a, **k: None)
        run = Run(config={}, bapo=loss_fn.options, off_path=set(), master_config=mc, policy=policy)
        installed = install_layers(run, AFTER_SETUP, layers=(layer("step bounds"),))
        return policy, installed

    policy, installed = with_step_bounds(fn)
    assert installed == ["step bounds"] and isinstance(policy.train, StepBoundsTrainer)
    assert policy.train.global_batch_size == 64
    assert policy.train.group_size == 16  # step_bounds_sample samples whole prompt groups
    micro, installed = with_step_bounds(make_loss_fn(SimpleNamespace(policy=policy_cfg, loss_fn=_loss_cfg(bapo={}))))
    assert installed == [] and not isinstance(micro.train, StepBoundsTrainer)


def test_step_granularity_without_driver_bounds_is_refused():
    from bapo_nemo.nemo.loss import BAPOLossFn

    data, curr, seqs, toks = _batch(5)
    fn = BAPOLossFn(_loss_cfg(bapo={"granularity": "step"}))
    with pytest.raises(ValueError, match="StepBoundsTrainer"):
        fn(curr.detach(), data, seqs, toks)
