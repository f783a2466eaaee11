"""Sequence packing with FP8 and `fuse_loss` on NeMo-RL's Megatron path: widen the training batch where the
installed NeMo-RL's fused loss input overflows (`installed.packed_loss_needs_full_width` decides).

With FP8 NeMo-RL grows a packed bin's last sequence to the FP8 multiple, and the fused loss copies that
many tokens out of a batch only as wide as its longest sequence (docs/nemo_rl.md, "Sequence packing needs
`fuse_loss: true`"). `PackedWidthGuard` wraps `policy.train` and right-pads every per-token tensor to
round_up(train_mb_tokens, FP8 multiple), masked: loss, gradients and metrics are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def fp8_packed_multiple(policy: Mapping[str, Any]) -> int:
    """The multiple NeMo-RL pads each packed micro-batch to (1 without FP8): v0.7.0's
    `_get_pack_sequence_parameters_for_megatron` (block 128 blockwise, 32 mxfp8, else 16; x 2*CP when
    CP > 1; x TP with sequence parallel)."""
    megatron = policy.get("megatron_cfg") or {}
    fp8 = megatron.get("fp8_cfg") or {}
    if not (megatron.get("enabled") and fp8.get("enabled")):
        return 1
    multiple = {"blockwise": 128, "mxfp8": 32}.get(fp8.get("fp8_recipe"), 16)
    cp, tp = int(megatron.get("context_parallel_size", 1)), int(megatron.get("tensor_model_parallel_size", 1))
    if cp > 1:
        multiple *= 2 * cp
    if tp > 1 and megatron.get("sequence_parallel"):
        multiple *= tp
    return multiple


def fused_loss_width(policy: Mapping[str, Any]) -> int | None:
    """The batch width the fused packed loss needs, or None when the configuration cannot overflow
    (no Megatron packing with fuse_loss, or no FP8 padding of packed micro-batches)."""
    packing = policy.get("sequence_packing") or {}
    if not (packing.get("enabled") and packing.get("fuse_loss")):
        return None
    multiple = fp8_packed_multiple(policy)
    if multiple == 1:
        return None
    capacity = int(packing["train_mb_tokens"])
    return -(-capacity // multiple) * multiple


def pad_sequence_dim(batch, width: int):
    """A shallow copy of `batch` whose [B, S] tensors are right-padded with zeros to `width` columns
    (tensors of another shape, e.g. [B] or S > width, are kept as they are)."""
    width = int(width)
    seq = batch["input_ids"].shape[1]
    copied = batch.__class__()
    copied.update(batch)
    if seq >= width:
        return copied
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == seq:
            copied[key] = torch.nn.functional.pad(value, (0, width - seq), value=0)
    return copied


class PackedWidthGuard:
    """Drop-in for `policy.train` that widens the batch to `width` first (see the module docstring)."""

    def __init__(self, train_fn: Callable, width: int):
        self.train_fn, self.width = train_fn, int(width)

    def __call__(self, data, loss_fn, *args, **kwargs):
        return self.train_fn(pad_sequence_dim(data, self.width), loss_fn, *args, **kwargs)


def install_packed_width_guard(policy, policy_config: Mapping[str, Any], needed: bool = True) -> int | None:
    """Wrap `policy.train` when the configuration needs it and the installed NeMo-RL overflows
    (`needed`: `installed.packed_loss_needs_full_width()`, False on NeMo-RL main, #3182); returns the width
    (None: not needed)."""
    width = fused_loss_width(policy_config) if needed else None
    if width is not None:
        policy.train = PackedWidthGuard(policy.train, width)
    return width
