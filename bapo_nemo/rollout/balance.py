"""Row order for one batched generate call that feeds several vLLM engines.

NeMo-RL's `VllmGeneration.generate` gives each engine a contiguous shard of ceil(n / engines) rows and
waits for the slowest. Partial rollouts queue the oldest, longest-context responses first, so
`balanced_order` deals the rows to the shards in turn, longest context first, giving every engine an
equal mix of long and short contexts (docs/cluster.md section 7 has the simulated effect).
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_order(context_lengths: Sequence[int], engines: int) -> list[int]:
    """Row indices in call order: sorted by context length (longest first, ties by index) and dealt to the
    contiguous shards in snake order (shard 0, 1, .., E-1, E-1, .., 0, 0, ..), skipping full shards;
    shard e is rows [e * ceil(n / E), (e + 1) * ceil(n / E)) of the call, as the backend cuts them."""
    n = len(context_lengths)
    if engines <= 1 or n <= 1:
        return list(range(n))
    size = -(-n // engines)
    # the backend's shard sizes: ceil(n / engines) rows each, the last ones shorter (or empty)
    room = [max(0, min(size, n - e * size)) for e in range(engines)]
    ranked = sorted(range(n), key=lambda i: (-context_lengths[i], i))
    shards: list[list[int]] = [[] for _ in range(engines)]
    e, step = 0, 1
    for i in ranked:
        while len(shards[e]) >= room[e]:
            e, step = _next(e, step, engines)
        shards[e].append(i)
        e, step = _next(e, step, engines)
    return [i for shard in shards for i in shard]


def _next(e: int, step: int, engines: int) -> tuple[int, int]:
    """Snake order: at either end the same shard is taken twice, then the direction turns."""
    if 0 <= e + step < engines:
        return e + step, step
    return e, -step
