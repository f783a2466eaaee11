"""CPU tests of BAPOLossFn's NeMo-RL-free logic: bound <-> epsilon conversion, reference log-prob
selection, the importance weights the search uses, metric naming/scaling under NeMo-RL's aggregation,
the `loss_fn.bapo` block, and the step-granularity driver wrapper (with a stand-in for NeMo-RL's Ray
Policy, which cannot run here: it only records calls and returns canned train() results)."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_nemo.algorithm import BAPOConfig, BAPOConfigError, search_clip_bounds
from bapo_nemo.algorithm.options import NemoBAPOOptions
from bapo_nemo.nemo.loss_math import (
    bounds_to_epsilons,
    data_for_parent,
    importance_weights_like_nemo,
    nemo_step_metrics,
    reference_logprobs,
    token_sign_counts,
)
from bapo_nemo.nemo.step_bounds import (
    STEP_BOUNDS_KEYS,
    StepBoundsTrainer,
    attach_bounds,
    bounds_from_data,
    merge_train_results,
    sampled_group_rows,
    search_result,
    search_step_bounds,
)
from tests.support.nemo_metrics import aggregate_like_nemo


def test_bounds_are_epsilons_for_the_parent():
    # GRPO's [0.8, 1.2] is epsilons (0.2, 0.2); BAPO's saturated [0.9, 3.0] is (0.1, 2.0)
    assert bounds_to_epsilons(0.8, 1.2) == pytest.approx((0.2, 0.2))
    assert bounds_to_epsilons(0.9, 3.0) == pytest.approx((0.1, 2.0))
    assert bounds_to_epsilons(0.62, 1.35) == pytest.approx((0.38, 0.35))


def test_reference_logprobs_and_parent_data():
    data = {
        "prev_logprobs": torch.tensor([[9.0, 1.0, 2.0]]),
        "generation_logprobs": torch.tensor([[9.0, 3.0, 4.0]]),
    }
    assert reference_logprobs(data, "proximal").tolist() == [[1.0, 2.0]]  # shifted like the parent ([:, 1:])
    assert reference_logprobs(data, "behavior").tolist() == [[3.0, 4.0]]
    assert data_for_parent(data, "proximal") is data
    swapped = data_for_parent(data, "behavior")
    assert swapped["prev_logprobs"] is data["generation_logprobs"]
    assert data["prev_logprobs"].tolist() == [[9.0, 1.0, 2.0]]  # the caller's batch is untouched


def test_importance_weights_match_nemo_truncation_rules():
    prev = torch.log(torch.tensor([[1.0, 3.0, 0.25], [2.0, 2.0, 2.0]]))
    gen = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # plain: w = exp(prev - gen) = [[1, 3, .25], [2, 2, 2]]
    plain = importance_weights_like_nemo(prev, gen, mask, None, None, None)
    torch.testing.assert_close(plain, torch.tensor([[1.0, 3.0, 0.25], [2.0, 2.0, 2.0]]))
    # tis with max 2, min default 0: clamp -> [[1, 2, .25], [2, 2, 2]]
    tis = importance_weights_like_nemo(prev, gen, mask, "tis", 2.0, None)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, 0.25], [2.0, 2.0, 2.0]]))
    # icepop [0.5, 2.5]: 3 and .25 are zeroed
    ice = importance_weights_like_nemo(prev, gen, mask, "icepop", 2.5, 0.5)
    torch.testing.assert_close(ice, torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]]))
    # seq-mask-tis [0.9, 1.5]: row 0 geo-mean = (1*3*.25)^(1/3) = 0.9086 -> kept; row 1 (masked 2 tokens)
    # geo-mean = 2 -> dropped
    seq = importance_weights_like_nemo(prev, gen, mask, "seq-mask-tis", 1.5, 0.9)
    torch.testing.assert_close(seq, torch.tensor([[1.0, 3.0, 0.25], [0.0, 0.0, 0.0]]))


def test_step_metrics_add_up_to_token_weighted_means_under_nemo_aggregation():
    """2 DP ranks x 2 micro-batches, global_valid_toks 10 (4 + 1 on rank 0, 3 + 2 on rank 1).
    Micro-batch 0 (both ranks) searched c_low 0.6, micro-batch 1 searched 0.7 (bounds are shared across
    DP ranks of one micro-batch index). Token-weighted mean = (0.6*(4+3) + 0.7*(1+2)) / 10 = 0.63."""

    def result(c_low):
        return search_result(c_low=c_low, c_high=1.2, rho=0.5, rho_initial=0.3, target_met=True, steps=2)

    def counts(n):
        return {"valid": n, "pos": n, "neg": 0.0, "clip_high": 1.0, "clip_low": 0.0, "dual": 0.0}

    rank0 = [[nemo_step_metrics(result(0.6), counts(4), 10), nemo_step_metrics(result(0.7), counts(1), 10)]]
    rank1 = [[nemo_step_metrics(result(0.6), counts(3), 10), nemo_step_metrics(result(0.7), counts(2), 10)]]
    agg = aggregate_like_nemo([rank0, rank1])
    assert agg["bapo/c_low"] == pytest.approx(0.63)
    assert agg["bapo/c_high"] == pytest.approx(1.2)
    assert agg["bapo/target_met"] == pytest.approx(1.0)
    assert agg["bapo/steps"] == pytest.approx(2.0)
    assert agg["bapo/clip_high_frac"] == pytest.approx(4 / 10)  # one clipped token per call, 4 calls
    assert not any("_min" in k or "_max" in k for k in agg), "such names are summed, not averaged, by NeMo-RL"


def test_two_optimizer_steps_per_train_call_average():
    """NeMo-RL divides by the number of global batches: bounds 0.6 then 0.8 log 0.7."""
    r = lambda c: search_result(c_low=c, c_high=1.2, rho=0.5, rho_initial=0.3, target_met=False, steps=0)
    cnt = {"valid": 4.0, "pos": 2.0, "neg": 2.0, "clip_high": 0.0, "clip_low": 1.0, "dual": 0.0}
    agg = aggregate_like_nemo([[[nemo_step_metrics(r(0.6), cnt, 4)], [nemo_step_metrics(r(0.8), cnt, 4)]]])
    assert agg["bapo/c_low"] == pytest.approx(0.7)
    assert agg["bapo/clip_low_frac"] == pytest.approx(0.25)


def test_token_sign_counts():
    ratio = torch.tensor([[0.5, 1.5, 1.0, 4.0]])
    adv = torch.tensor([[-1.0, 1.0, 0.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    c = token_sign_counts(ratio, adv, mask, 0.8, 1.2, dual_clip=3.0)
    assert c == {"valid": 4.0, "pos": 1.0, "neg": 2.0, "clip_high": 1.0, "clip_low": 1.0, "dual": 1.0}


def test_options_block_parsing_names_keys():
    o = NemoBAPOOptions.parse({"rho0": 0.35, "ratio_reference": "proximal", "granularity": "step"})
    assert (o.ratio_reference, o.bapo.rho0, o.bapo.granularity) == ("proximal", 0.35, "step")
    assert o.flat()["ratio_reference"] == "proximal"
    assert NemoBAPOOptions.parse(None).ratio_reference == "behavior"
    with pytest.raises(BAPOConfigError, match=r"loss_fn\.bapo\.ratio_reference"):
        NemoBAPOOptions.parse({"ratio_reference": "old"})
    with pytest.raises(BAPOConfigError, match=r"loss_fn\.bapo\.c_hgh_max: unknown key"):
        NemoBAPOOptions.parse({"c_hgh_max": 2.0})


class _Batch(dict):
    """NeMo-RL's BatchedDataDict surface the wrapper uses (.size, .slice)."""

    @property
    def size(self):
        return self["sample_mask"].shape[0]

    def slice(self, a, b):
        return _Batch({k: v[a:b] for k, v in self.items()})

    def select_indices(self, rows):
        return _Batch({k: v[rows] for k, v in self.items()})


def _train_batch(n=4, s=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(n, s, generator=g, dtype=torch.float64)
    return _Batch(
        token_mask=torch.ones(n, s, dtype=torch.float64),
        sample_mask=torch.ones(n, dtype=torch.float64),
        advantages=torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, s).clone(),
        generation_logprobs=gen,
        prev_logprobs=gen + 0.5 * torch.randn(n, s, generator=g, dtype=torch.float64),
    )


def test_attach_and_read_step_bounds():
    batch = _train_batch()
    res = search_result(c_low=0.64, c_high=1.55, rho=0.41, rho_initial=0.2, target_met=True, steps=9)
    attach_bounds(batch, res)
    assert all(batch[k].shape == (4,) for k in STEP_BOUNDS_KEYS)
    back = bounds_from_data(batch.slice(2, 3))  # survives slicing into a micro-batch
    assert (back.c_low, back.c_high, back.rho, back.target_met, back.steps) == (0.64, 1.55, 0.41, True, 9)


def test_step_bounds_trainer_splits_calls_and_uses_extra_logprob_pass():
    """Two optimizer steps in one train() call: step 1 uses prev_logprobs (no extra pass), step 2 one
    get_logprobs pass; each call carries the bounds searched over its whole global batch."""
    options = NemoBAPOOptions.parse({"granularity": "step", "ratio_reference": "behavior"})
    batch = _train_batch(n=4)
    shifted = batch["prev_logprobs"] + 0.3

    class Policy:  # stand-in for NeMo-RL's Ray-backed Policy (boundary: needs GPUs + Ray workers)
        def __init__(self):
            self.train_calls, self.logprob_calls = [], 0

        def train(
            self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None, check_dim_skip_keys=None
        ):
            self.train_calls.append(data)
            return {
                "loss": torch.tensor([1.0]),
                "grad_norm": torch.tensor([0.5]),
                "all_mb_metrics": {
                    "bapo/c_low": [float(data["bapo_c_low"][0])],
                    "probs_ratio_max": [2.0],
                    "lr": [1e-6],
                },
            }

        def get_logprobs(self, data, timer=None):
            self.logprob_calls += 1
            return {"logprobs": shifted[2:]}

    policy = Policy()
    trainer = StepBoundsTrainer(policy, options, {}, global_batch_size=2)
    out = trainer(batch, loss_fn=None)
    assert len(policy.train_calls) == 2 and policy.logprob_calls == 1
    first = search_step_bounds(batch.slice(0, 2), batch["prev_logprobs"][:2], options, {})
    second = search_step_bounds(batch.slice(2, 4), shifted[2:], options, {})
    assert float(policy.train_calls[0]["bapo_c_high"][0]) == first.c_high
    assert float(policy.train_calls[1]["bapo_c_high"][0]) == second.c_high
    # merged like one 2-step call: per-step metrics halved (NeMo-RL divides by global batches), _max kept
    assert out["all_mb_metrics"]["bapo/c_low"] == pytest.approx([first.c_low / 2, second.c_low / 2])
    assert out["all_mb_metrics"]["probs_ratio_max"] == [2.0, 2.0]
    assert out["all_mb_metrics"]["lr"] == [1e-6, 1e-6]
    assert out["loss"].tolist() == [1.0, 1.0]


def test_sampled_group_rows_are_whole_groups_by_hand():
    g = torch.Generator().manual_seed(0)
    rows = sampled_group_rows(8, 2, 0.5, g)  # 4 groups of 2 -> 2 groups
    assert len(rows) == 4 and rows == sorted(rows)
    assert all(rows[i] % 2 == 0 and rows[i + 1] == rows[i] + 1 for i in range(0, 4, 2))
    assert len(sampled_group_rows(8, 2, 0.01, g)) == 2  # at least one group
    # 6 groups of 2, f 0.25 -> round(1.5) = 2 groups = 4 rows; 3 data-parallel ranks -> 3 groups
    assert len(sampled_group_rows(12, 2, 0.25, g)) == 4
    assert len(sampled_group_rows(12, 2, 0.25, g, row_multiple=3)) == 6
    assert sampled_group_rows(4, 2, 0.5, g, row_multiple=8) == [0, 1, 2, 3]  # all groups, at most


class _LogprobPolicy:
    """Stand-in for NeMo-RL's Ray-backed Policy (needs GPUs): records the rows of each get_logprobs pass
    and answers with fixed 'current' log-probs for them; train() returns a canned result."""

    def __init__(self, current):
        self.current, self.logprob_rows, self.train_calls = current, [], []

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None, check_dim_skip_keys=None):
        self.train_calls.append(data)
        return {"loss": torch.tensor([1.0]), "grad_norm": torch.tensor([0.5]), "all_mb_metrics": {}}

    def get_logprobs(self, data, timer=None):
        rows = [int(x) for x in data["row"]]
        self.logprob_rows.append(rows)
        return {"logprobs": self.current[rows]}


@pytest.mark.parametrize("sample", [0.5, 0.0])
def test_step_bounds_sample_searches_later_steps_on_a_sample(sample):
    """Two optimizer steps of 4 rows (2 groups of 2): step 1 searches its whole batch on prev_logprobs;
    step 2 searches one sampled group at the current log-probs (0.5), or its whole batch on
    prev_logprobs without any extra pass (0)."""
    options = NemoBAPOOptions.parse({"granularity": "step", "step_bounds_sample": sample})
    batch = _train_batch(n=8, s=6, seed=4)
    batch["row"] = torch.arange(8)
    current = batch["prev_logprobs"] + 0.4 * torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    policy = _LogprobPolicy(current)
    StepBoundsTrainer(policy, options, {}, global_batch_size=4, group_size=2, seed=1)(batch, loss_fn=None)
    first = search_step_bounds(batch.slice(0, 4), batch["prev_logprobs"][:4], options, {})
    assert float(policy.train_calls[0]["bapo_c_high"][0]) == first.c_high
    second_batch = batch.slice(4, 8)
    if sample == 0:
        assert policy.logprob_rows == []
        want = search_step_bounds(second_batch, second_batch["prev_logprobs"], options, {})
    else:
        [rows] = policy.logprob_rows
        assert rows in ([4, 5], [6, 7])  # one whole group of the second global batch
        picked = second_batch.select_indices([r - 4 for r in rows])
        want = search_step_bounds(picked, current[rows], options, {})
    got = policy.train_calls[1]
    assert (float(got["bapo_c_low"][0]), float(got["bapo_c_high"][0])) == (want.c_low, want.c_high)
    assert got.size == 4  # the bounds clip the whole step


def test_step_bounds_sample_needs_whole_groups_in_a_global_batch():
    options = NemoBAPOOptions.parse({"granularity": "step", "step_bounds_sample": 0.25})
    with pytest.raises(ValueError, match="step_bounds_sample=0.25.*train_global_batch_size=6.*per_prompt=4"):
        StepBoundsTrainer(_LogprobPolicy(None), options, {}, global_batch_size=6, group_size=4)
    with pytest.raises(BAPOConfigError, match=r"loss_fn\.bapo\.step_bounds_sample"):
        NemoBAPOOptions.parse({"step_bounds_sample": 1.5})


def test_step_search_equals_core_search_on_the_whole_batch():
    """Driver-side search = the core search over every token of the global batch (behaviour ratio)."""
    options = NemoBAPOOptions.parse({"ratio_reference": "behavior"})
    batch = _train_batch(n=6, s=7, seed=3)
    got = search_step_bounds(batch, batch["prev_logprobs"], options, {})
    ratio = torch.exp(batch["prev_logprobs"][:, 1:] - batch["generation_logprobs"][:, 1:])
    want = search_clip_bounds(ratio, batch["advantages"][:, 1:], batch["token_mask"][:, 1:], BAPOConfig())
    assert (got.c_low, got.c_high, got.steps) == (want.c_low, want.c_high, want.steps)
    assert math.isclose(got.rho, want.rho, rel_tol=1e-12)


def test_merge_single_result_passthrough():
    r = {"loss": torch.tensor([2.0]), "grad_norm": torch.tensor([1.0]), "all_mb_metrics": {"x": [1.0]}}
    m = merge_train_results([r])
    assert m["all_mb_metrics"]["x"] == [1.0] and m["loss"].tolist() == [2.0]
