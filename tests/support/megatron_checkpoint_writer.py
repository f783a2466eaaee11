"""Test helper: real megatron-core dist_checkpointing saves (torch_dist format) on CPU over gloo.

`save_weights(iteration_dir, world, floats, report)` forks `world` ranks that save one tensor-parallel
style sharded weight and its Adam moment (each rank its slice) into Megatron-Bridge's layout
(`<weights>/iter_0000000` + the tracker file), as NeMo-RL's Megatron worker does under `policy/weights`.
CUDA calls on that path run on the CPU through tests/support/nemo_rl_shim/megatron_cpu.py (there is no GPU here;
forked ranks only, never the pytest process). A rank whose save raises writes, to `report`, the exception's
type and what `no_space_left` says of it, with and without the checkpoint directory.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _rank(rank: int, world: int, target: str, floats: int, port: int, report: str) -> None:
    sys.path.insert(0, str(REPO))
    from tests.support.nemo_rl_shim import megatron_cpu

    megatron_cpu._install_cuda_on_cpu()  # the CPU stands in for the GPU (torch.cuda.synchronize, devices)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # megatron-core starts its results-queue Manager with "spawn" (a fresh interpreter re-importing this
    # test); a CPU process can fork it (as tests/support/nemo_rl_shim/megatron_cpu.py does)
    filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
    part = floats // world
    weight = torch.arange(rank * part, (rank + 1) * part, dtype=torch.float32).reshape(1, part)
    state = {
        "model": {"w": ShardedTensor.from_rank_offsets("model.w", weight, (1, rank, world), replica_id=0)},
        "optimizer": {"exp_avg": ShardedTensor.from_rank_offsets("optimizer.exp_avg", weight * 2, (1, rank, world),
                                                                 replica_id=0), "step": 3},
        "iteration": 0,
    }
    directory = Path(target)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    try:
        dist_checkpointing.save(state, str(directory))
        dist.barrier()
        if rank == 0:
            (directory.parent / "latest_checkpointed_iteration.txt").write_text("0")
    except BaseException as exc:
        from bapo_nemo.nemo.checkpoint_integrity import no_space_left

        Path(f"{report}.{rank}").write_text(json.dumps({
            "type": type(exc).__name__, "text": str(exc)[-2000:],
            "no_space_left": no_space_left(exc), "no_space_left_here": no_space_left(exc, directory),
        }))
        raise
    finally:
        dist.destroy_process_group()


def save_weights(iteration_dir: str | os.PathLike, world: int = 2, floats: int = 1000,
                 report: str | os.PathLike = "") -> list[dict]:
    """Save and return each failed rank's report (empty when the save succeeded)."""
    import torch.multiprocessing as mp

    report = str(report or Path(iteration_dir).parent / "save_report")
    try:
        mp.start_processes(_rank, args=(world, str(iteration_dir), floats, free_port(), report), nprocs=world,
                           start_method="fork")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        pass
    return [json.loads(Path(f"{report}.{r}").read_text()) for r in range(world) if Path(f"{report}.{r}").exists()]


if __name__ == "__main__":
    print(json.dumps(save_weights(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])))
