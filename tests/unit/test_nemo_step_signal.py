"""What a NeMo-RL step had to learn from (bapo_nemo/nemo/step_signal.py): the share of tied GRPO groups and
BAPO's positive share only where it is defined (the warning through NeMo-RL's real Logger:
tests/nemo_rl/test_step_signal.py; the values MLflow gets from a real GRPO run: tests/nemo_rl/test_driver_e2e.py)."""

from __future__ import annotations

import math

import pytest
import torch

from bapo_nemo.nemo.loss_math import nemo_step_metrics
from bapo_nemo.nemo.step_signal import signal_weighted_shares, zero_spread_share


def search_result(rho: float, rho_initial: float):
    from bapo_nemo.nemo.step_bounds import search_result as result  # the other fields 0

    return result(c_low=0.6, c_high=1.2, rho=rho, rho_initial=rho_initial, target_met=True, steps=1)


def counts(valid: float, pos: float, neg: float) -> dict[str, float]:
    return {"valid": valid, "pos": pos, "neg": neg, "clip_high": 0.0, "clip_low": 0.0, "dual": 0.0}


def as_lists(per_microbatch: list[dict[str, float]], num_global_batches: int = 1) -> dict[str, list]:
    """What Policy.train returns as all_mb_metrics: one list per name, each value over the number of
    optimizer steps of the call (names without _min/_max)."""
    out: dict[str, list] = {}
    for metrics in per_microbatch:
        for name, value in metrics.items():
            out.setdefault(name, []).append(value / num_global_batches)
    return out


def test_rho_is_the_signal_weighted_mean_of_the_searches():
    """2 DP ranks x 2 micro-batches, 10 valid tokens. Micro-batch 0 searched rho 0.4 (rho_initial 0.3) on 3
    + 1 signal tokens; micro-batch 1 has 4 valid tokens, none with an advantage, where the search reports
    1.0. The step's rho is 0.4, not the token-weighted (0.4 * 6 + 1.0 * 4) / 10 = 0.64."""
    g = 10
    lists = as_lists(
        [
            nemo_step_metrics(search_result(0.4, 0.3), counts(4, 2, 1), g),
            nemo_step_metrics(search_result(1.0, 1.0), counts(2, 0, 0), g),
            nemo_step_metrics(search_result(0.4, 0.3), counts(2, 0, 1), g),
            nemo_step_metrics(search_result(1.0, 1.0), counts(2, 0, 0), g),
        ]
    )
    shares = signal_weighted_shares(lists)
    assert sum(shares["bapo/rho"]) == pytest.approx(0.4)
    assert sum(shares["bapo/rho_initial"]) == pytest.approx(0.3)
    assert shares["bapo/c_low"] == lists["bapo/c_low"]  # the rest untouched


def test_two_optimizer_steps_weigh_by_each_steps_signal_share():
    """Step 1: rho 0.2 on 2 signal tokens of 4; step 2: rho 0.8 on 4 of 4. Weights 2/4 and 4/4:
    (0.2 * 0.5 + 0.8 * 1.0) / 1.5 = 0.6."""
    lists = as_lists(
        [
            nemo_step_metrics(search_result(0.2, 0.2), counts(4, 1, 1), 4),
            nemo_step_metrics(search_result(0.8, 0.8), counts(4, 2, 2), 4),
        ],
        num_global_batches=2,
    )
    assert sum(signal_weighted_shares(lists)["bapo/rho"]) == pytest.approx(0.6)


def test_a_step_without_signal_logs_no_rho():
    lists = as_lists([nemo_step_metrics(search_result(1.0, 1.0), counts(5, 0, 0), 5)])
    shares = signal_weighted_shares(lists)
    assert "bapo/rho" not in shares and "bapo/rho_initial" not in shares
    assert sum(shares["bapo/c_high"]) == pytest.approx(1.2)


def test_zero_spread_share_counts_valid_responses_whose_advantages_are_all_zero():
    """3 groups of 2 responses (column 0 is the prompt, dropped like the loss drops it). Group 0 tied (0, 0),
    group 1 mixed (+0.5, -0.5), group 2 tied but one response masked out: 1 + 1 of 5 valid responses.
    A zero advantage on a masked token does not count as signal, nor one on the prompt column."""
    advantages = torch.tensor(
        [
            [9.0, 0.0, 0.0],
            [9.0, 0.0, 0.0],
            [0.0, 0.5, 0.5],
            [0.0, -0.5, -0.5],
            [0.0, 0.0, 0.0],
            [0.0, 0.0, 7.0],  # masked-out sample
        ]
    )
    token_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]])
    sample_mask = torch.tensor([1, 1, 1, 1, 1, 0])
    data = {"advantages": advantages, "token_mask": token_mask, "sample_mask": sample_mask}
    assert zero_spread_share(data) == pytest.approx(3 / 5)
    data["sample_mask"] = torch.zeros(6)
    assert math.isnan(zero_spread_share(data))


