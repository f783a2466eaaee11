"""Which ranks BAPO's bound statistics are summed over inside NeMo-RL, and the sum itself: every token of one
optimizer step exactly once (docs/nemo_rl.md, "Which ranks the statistics are summed over, and why").

- Megatron: `parallel_state.get_data_parallel_group()` without CP (only the last PP stage calls the loss;
  TP and CP ranks hold the same tokens).
- DTensor: the worker's `dp` mesh group, rebuilt from NeMo-RL's [DP, CP, TP] rank layout (the DP peers of
  rank r share r mod (CP*TP)); CP-sharded inputs are gathered to full length first.
"""

from __future__ import annotations

import torch

from bapo_nemo.algorithm import AllReduce, process_group_all_reduce

# One DP group per (world size, tp, cp): new groups are collective, so build them once per process.
_DTENSOR_GROUPS: dict[tuple[int, int, int], object] = {}


def dtensor_dp_rank_lists(world_size: int, tensor_parallel: int, context_parallel: int) -> list[list[int]]:
    """Data-parallel rank groups of NeMo-RL's [DP, CP, TP] layout (TP fastest).

    world 8, tp 2, cp 2 -> DP 2: ranks {0, 4}, {1, 5}, {2, 6}, {3, 7} share one optimizer step.
    """
    model_parallel = tensor_parallel * context_parallel
    if model_parallel < 1 or world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not a multiple of tensor_parallel_size * context_parallel_size = "
            f"{tensor_parallel} * {context_parallel}: fix policy.dtensor_cfg or the cluster shape"
        )
    return [list(range(offset, world_size, model_parallel)) for offset in range(model_parallel)]


def _megatron_dp_group():
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=False)


def data_parallel_group(dtensor_tp: int = 1, dtensor_cp: int = 1):
    """The process group of the ranks that share one optimizer step, or None for a single process.

    Megatron's parallel state wins when it is initialised (Megatron worker); otherwise the DTensor
    layout (tp, cp) of the policy config is used; WORLD when tp * cp == 1.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = _megatron_dp_group()
    if group is not None:
        return group
    if dtensor_tp * dtensor_cp == 1:
        return dist.group.WORLD
    key = (dist.get_world_size(), dtensor_tp, dtensor_cp)
    if key not in _DTENSOR_GROUPS:
        # new_subgroups_by_enumeration is collective over WORLD: every rank calls it in the same order
        # (DTensor ranks all run the loss in lockstep, micro-batch by micro-batch).
        mine, _ = dist.new_subgroups_by_enumeration(dtensor_dp_rank_lists(*key))
        _DTENSOR_GROUPS[key] = mine
    return _DTENSOR_GROUPS[key]


def data_parallel_all_reduce(dtensor_tp: int = 1, dtensor_cp: int = 1) -> AllReduce | None:
    """Sum over the data-parallel group (None when not distributed: the search then needs no collective)."""
    import torch.distributed as dist

    group = data_parallel_group(dtensor_tp, dtensor_cp)
    if group is None:
        return None
    if dist.get_world_size(group) == 1:
        return None
    return process_group_all_reduce(group)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (CP-sharded under the DTensor backend) gathered to the full local micro-batch."""
    if hasattr(t, "full_tensor") and callable(t.full_tensor):
        return t.full_tensor()
    return t
