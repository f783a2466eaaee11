"""Grouped-query attention without copying the keys and values on CPU.

transformers' "sdpa" attention repeats every key/value head for its query heads (`repeat_kv`) unless no
attention mask is given or the device is a GPU, and our batches always carry a mask; PyTorch's SDPA takes
the groups itself (`enable_gqa=True`). `use_gqa_sdpa(model)` registers that as attention implementation
"sdpa_gqa" (with sdpa's masks) for a model that uses "sdpa"; anything else falls through to transformers.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' sdpa attention, with the key/value groups left to PyTorch when a mask is given on CPU
    (with a mask, transformers' sdpa passes is_causal=False and the mask as is: so does this)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups == 1
        or attention_mask is None
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
        or kwargs.get("output_attentions", False)
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model) -> None:
    """Select "sdpa_gqa" for `model` if it attends with "sdpa" (other implementations are left alone)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(NAME, gqa_sdpa_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
