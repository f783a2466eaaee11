"""FP8 packing with `fuse_loss` (bapo_nemo/nemo/packing.py): how wide the training batch must be (NeMo-RL's own
packing on the 32B config's shapes: tests/nemo_rl/test_packing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bapo_nemo.nemo.packing import (
    PackedWidthGuard,
    fp8_packed_multiple,
    fused_loss_width,
    install_packed_width_guard,
    pad_sequence_dim,
)
from bapo_nemo.plan.rules.config_io import load_nemo_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "multiple", "width"),
    [
        # 128 (blockwise) x 2*CP x TP (sequence parallel); width = train_mb_tokens rounded up to it
        ("bapo_7b.yaml", 128 * 4 * 4, 34816),  # 34,816 = 17 x 2,048
        ("bapo_32b.yaml", 128 * 8 * 8, 40960),  # 40,960 = 5 x 8,192
        ("bapo_32b_64k.yaml", 128 * 16 * 8, 65536),
    ],
)
def test_the_width_the_shipped_configs_need(name, multiple, width):
    policy = load_nemo_config(REPO / "configs" / name)["policy"]
    assert fp8_packed_multiple(policy) == multiple
    assert fused_loss_width(policy) == width


def test_no_widening_without_fp8_or_without_the_fused_loss():
    policy = load_nemo_config(REPO / "configs" / "bapo_32b.yaml")["policy"]
    policy["megatron_cfg"]["fp8_cfg"]["enabled"] = False
    assert fused_loss_width(policy) is None
    policy["megatron_cfg"]["fp8_cfg"]["enabled"] = True
    policy["sequence_packing"]["fuse_loss"] = False
    assert fused_loss_width(policy) is None


def test_padding_keeps_every_column_and_masks_the_new_ones():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
        "token_mask": torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]),
        "input_lengths": torch.tensor([3, 2]),
        "bapo_c_low": torch.tensor([0.6, 0.6], dtype=torch.float64),
    }
    wide = pad_sequence_dim(batch, 5)
    assert wide["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]]
    assert wide["token_mask"].tolist() == [[0, 1, 1, 0, 0], [0, 1, 0, 0, 0]]
    assert torch.equal(wide["input_lengths"], batch["input_lengths"])  # per-sample columns untouched
    assert torch.equal(wide["bapo_c_low"], batch["bapo_c_low"])
    assert batch["input_ids"].shape == (2, 3)  # the caller's batch is not changed
    seen = []
    PackedWidthGuard(lambda data, loss_fn, **kw: seen.append((data["input_ids"].shape, kw)), 8)(batch, None, gbs=2)
    assert seen == [((2, 8), {"gbs": 2})]


def test_the_guard_is_installed_only_where_it_is_needed():
    from types import SimpleNamespace

    policy = load_nemo_config(REPO / "configs" / "bapo_32b.yaml")["policy"]
    train = lambda data, loss_fn, **kw: None
    needed, fixed = SimpleNamespace(train=train), SimpleNamespace(train=train)
    assert install_packed_width_guard(needed, policy, needed=True) == 40960
    assert isinstance(needed.train, PackedWidthGuard) and needed.train.width == 40960
    assert install_packed_width_guard(fixed, policy, needed=False) is None and fixed.train is train
