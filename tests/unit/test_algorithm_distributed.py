"""Real torch.distributed (gloo, 2 processes): bounds chosen on two ranks with the one all-reduce equal the
single-process bounds on the concatenated batch, for both orders and both measures."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bapo_nemo.algorithm import BAPOConfig, process_group_all_reduce, search_clip_bounds
from tests.support.hang_guard import HANG_GUARD_S

CONFIGS = {
    "paper-value": BAPOConfig(measure="value"),
    "paper-gradient": BAPOConfig(measure="gradient", dual_clip=3.5),
    "reference": BAPOConfig.from_reference_recipe(adv_ratio_target=0.8, measure="gradient"),
}


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(torch.randn(8, 64, generator=g) * 0.5)
    adv = (torch.randn(8, 1, generator=g) - 0.2).expand(8, 64)  # tilted negative: the search moves
    mask = (torch.rand(8, 64, generator=g) > 0.1).float()
    return ratio, adv, mask


def _worker(rank: int, world: int, rendezvous: str, out):
    # A file rendezvous: no port to choose, so none another process can take first.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        ratio, adv, mask = _batch(seed=rank)
        group = dist.new_group(ranks=list(range(world)))  # stands in for the data-parallel group
        calls = []
        reduce = process_group_all_reduce(group)

        def counted(t):
            calls.append(1)
            return reduce(t)

        results = {name: search_clip_bounds(ratio, adv, mask, cfg, counted) for name, cfg in CONFIGS.items()}
        out.put((rank, results, len(calls)))
    finally:
        dist.destroy_process_group()


def test_two_ranks_choose_the_bounds_of_the_concatenated_batch(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, str(tmp_path / "rendezvous"), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=HANG_GUARD_S) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    got.sort(key=lambda x: x[0])

    parts = [_batch(seed=r) for r in range(2)]
    ratio, adv, mask = (torch.cat([p[i] for p in parts]) for i in range(3))
    moved = 0
    for name, cfg in CONFIGS.items():
        single = search_clip_bounds(ratio, adv, mask, cfg)
        moved += single.steps > 0
        # Each rank alone would choose other bounds: agreement comes from the reduction.
        assert any(search_clip_bounds(*_batch(seed=r), cfg).steps != single.steps for r in range(2)), name
        for rank, results, n_calls in got:
            assert n_calls == len(CONFIGS)  # exactly one collective per search
            res = results[name]
            assert (res.c_low, res.c_high, res.steps, res.target_met) == (
                single.c_low, single.c_high, single.steps, single.target_met,
            ), (name, rank)
            assert res.rho == pytest.approx(single.rho, rel=1e-12)
            assert res.num_tokens == single.num_tokens
    assert moved >= 2  # the data make the search move, so agreement is not just the starting bounds
