"""The compute `granularity: step` adds (`bapo_nemo.plan.simulation.step_cost`), on a hand-computed shape and on the
shipped 32B config as `bapo-nemo check --json` reports it."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from bapo_nemo.cli import main as cli_main
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.simulation.step_cost import forward_flops, step_granularity_cost

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = ModelShape(
    "tiny",
    hidden_size=2,
    num_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=2,
    intermediate_size=4,
    vocab_size=10,
    tie_word_embeddings=False,
)


def test_forward_flops_by_hand():
    # layer weights: q 2*2 + k,v 2*(2*2) + o 2*2 + MLP 3*2*4 = 40; output layer 10*2 = 20
    # s = 3, s^2 = 9: 2*40*3 + 2*20*3 + 2*1*2*9 = 240 + 120 + 36
    assert forward_flops(TINY, 3, 9) == 396


@pytest.mark.parametrize("recompute,train_forwards", [(True, 4), (False, 3)])
def test_step_cost_shares(recompute, train_forwards):
    """1,024 responses in 4 optimizer steps: 3 extra passes over 256 = 0.75 forward over the batch,
    against prev_logprobs (1) + training (3 or 4) forwards, + 1 for generation."""
    cost = step_granularity_cost(TINY, 1024, 256, recompute, 3, 9)
    fwd = 1024 * 396
    assert cost.optimizer_steps == 4 and cost.extra_passes == 3
    assert cost.extra_pflops * 1e15 == pytest.approx(0.75 * fwd)
    assert cost.share_of_training == pytest.approx(0.75 / (1 + train_forwards + 0.75))
    assert cost.share_of_step == pytest.approx(0.75 / (2 + train_forwards + 0.75))
    assert step_granularity_cost(TINY, 256, 256, recompute, 3, 9).extra_passes == 0


def test_check_reports_the_32b_cost():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(
            ["check", str(CONFIGS / "bapo_32b.yaml"), "--nodes", "8", "--gpus-per-node", "8", "--json"]
        )
    assert code == 0
    cost = json.loads(buf.getvalue())["step_granularity_cost"]
    assert cost["extra_passes"] == 3  # 64 x 16 = 1,024 responses / 256 per optimizer step - 1
    assert cost["share_of_training"] == pytest.approx(0.75 / 5.75)  # full recompute on
    # ~1,024 responses x ~12.5k tokens x ~2 x 32e9 FLOPs/token: hundreds of PFLOPs per forward
    assert 500 < cost["forward_pflops"] < 1500
