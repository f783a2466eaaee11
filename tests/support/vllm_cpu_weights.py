"""Imported inside vLLM's worker process (named as the engine's `worker_extension_cls`) before it loads the
model: keeps the linear layers' weights as parameters on the CPU backend, as they are on a GPU.

Why: vLLM's CPU build pre-packs every linear weight once after loading (oneDNN or its own kernels) and
frees the parameter (`dispatch_cpu_unquantized_gemm`, `remove_weight=True`); the output layer keeps its
parameter but computes from the packed copy. A refit (`model.load_weights` with new tensors, where
NeMo-RL's weight transport ends) then finds empty parameters, or updates a parameter nothing reads. On a
GPU, vLLM's unquantised layers read their parameters at every call; here they do the same through
`torch.nn.functional.linear`, vLLM's own fallback on CPUs without oneDNN. Nothing else is changed.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers import utils as layer_utils


def _read_parameters_at_each_call(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


if not hasattr(layer_utils, "dispatch_cpu_unquantized_gemm"):
    raise ImportError(
        "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is gone from this vLLM release: find "
        "where its CPU backend now packs linear weights and keep them as parameters there instead"
    )
layer_utils.dispatch_cpu_unquantized_gemm = _read_parameters_at_each_call


class KeepWeightsAsParameters:
    """Adds no method to vLLM's worker: naming it is what loads this module in the worker's process."""
