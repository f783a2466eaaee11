"""Four gloo processes running the data-parallel reduction BAPOLossFn uses: TP = 2, DP = 2, TP fastest
(NeMo-RL's DTensor layout and Megatron's default order), so ranks {0, 1} are one model replica (TP peers
holding the same micro-batch) and {2, 3} the other. The bounds every rank computes must equal a
single-process search over the two replicas' tokens, each token counted once (a WORLD reduction would count
every token twice, and with PP it would deadlock)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bapo_nemo.algorithm import BAPOConfig, search_clip_bounds
from bapo_nemo.nemo.groups import data_parallel_all_reduce


def replica_data(replica: int):
    g = torch.Generator().manual_seed(100 + replica)
    ratio = torch.exp(0.4 * torch.randn(3, 50, generator=g, dtype=torch.float64))
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 50)
    mask = (torch.rand(3, 50, generator=g) > 0.2).to(torch.float64)
    return ratio, adv, mask


def _worker(rank: int, world: int, init_file: str, out_dir: str, backend: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tp = 2
        replica = rank // tp  # TP fastest
        ratio, adv, mask = replica_data(replica)
        if backend == "megatron":
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            # the DTensor arguments are ignored once Megatron's parallel state exists
            reduce = data_parallel_all_reduce(dtensor_tp=1, dtensor_cp=1)
        else:
            reduce = data_parallel_all_reduce(dtensor_tp=tp, dtensor_cp=1)
        result = search_clip_bounds(ratio, adv, mask, BAPOConfig(), all_reduce=reduce)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def check_four_ranks_reduce_over_data_parallel_only(tmp_path, backend: str) -> None:
    """Every rank's bounds equal one process's search over both replicas' tokens, each counted once."""
    world = 4
    # fork: the children inherit the imported torch (CPU only, no CUDA state), 4 x faster than spawn
    mp.start_processes(
        _worker,
        args=(world, str(tmp_path / "init"), str(tmp_path), backend),
        nprocs=world,
        start_method="fork",
    )
    parts = [replica_data(r) for r in (0, 1)]
    expected = search_clip_bounds(
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts]),
        BAPOConfig(),
    )
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in results:
        assert (r.c_low, r.c_high, r.steps) == (expected.c_low, expected.c_high, expected.steps)
        assert r.rho == pytest.approx(expected.rho, rel=1e-12)
        # each token once: the DP sum, not the WORLD sum (which would be twice this)
        assert r.num_tokens == expected.num_tokens
