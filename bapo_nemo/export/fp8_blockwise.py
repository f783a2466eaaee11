"""A CPU stand-in for Transformer Engine's blockwise FP8 forward (`fp8_recipe: blockwise`, as the shipped
NeMo-RL configs train), to measure how far FP8-computed log-probs sit from a bf16 reload.

`blockwise_fp8_linears(model)` makes every `nn.Linear` but the output head quantise-dequantise its input
in 1x128 tiles and its weight in 128x128 blocks to e4m3 (one fp32 scale per tile, amax -> 448) before its
matmul. Not TE's kernel: the accumulation order differs, far below the quantisation error measured.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0
TILE = 128


def quantize_dequantize(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x (2-D) through float8 e4m3 with one fp32 scale per `rows` x `cols` block."""
    r, c = x.shape
    pr, pc = -r % rows, -c % cols
    xf = F.pad(x.float(), (0, pc, 0, pr))
    blocks = xf.view((r + pr) // rows, rows, (c + pc) // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    scale = E4M3_MAX / amax
    q = (blocks * scale).to(torch.float8_e4m3fn).float() / scale
    return q.view(r + pr, c + pc)[:r, :c].to(x.dtype)


def _fp8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    xq = quantize_dequantize(x.reshape(-1, shape[-1]), 1, TILE)
    wq = quantize_dequantize(self.weight, TILE, TILE)
    out = xq.float() @ wq.float().t()
    if self.bias is not None:
        out = out + self.bias.float()
    return out.to(x.dtype).reshape(*shape[:-1], -1)


@contextmanager
def blockwise_fp8_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)):
    """Within the block, every Linear of `model` except those named in `skip` runs blockwise FP8."""
    patched = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in skip:
            module.forward = _fp8_forward.__get__(module)
            patched.append(module)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward
