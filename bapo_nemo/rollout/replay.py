"""Sample replay across optimizer steps, with a staleness bound, and the mini-batch split that runs
several updates on one rollout batch (the paper's staleness 2x/4x/8x)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from typing import Any, Literal

import torch

from bapo_nemo.rollout.types import Rollout, RolloutGroup

Eviction = Literal["oldest"]
_GROUP_TAG = "__rollout_group__"


class ReplayStateError(ValueError):
    """A saved replay-buffer state cannot be loaded; the message names the field."""


class ReplayBuffer:
    """A bounded buffer of completed rollout groups (or any JSON-serialisable samples) tagged with the
    policy version that produced them.

    - Staleness bound: `sample` never returns an item older than `max_staleness` versions
      (current_version - item_version <= max_staleness); stale items are evicted first.
    - Eviction when full: `eviction="oldest"` drops the items with the lowest policy version (earliest
      added among equals) to make room.
    Items stay in the buffer after being sampled, so one sample can be reused until it goes stale.
    """

    def __init__(self, capacity: int, max_staleness: int, eviction: Eviction = "oldest"):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"ReplayBuffer capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(
                f"ReplayBuffer max_staleness must be an int >= 0 (0 = only the current policy's samples), "
                f"got {max_staleness!r}"
            )
        if eviction != "oldest":
            raise ValueError(f"ReplayBuffer eviction must be 'oldest', got {eviction!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.eviction = eviction
        self._items: list[tuple[int, int, Any]] = []  # (policy_version, insertion sequence number, item)
        self._next_seq = 0
        self.evicted_stale = 0
        self.evicted_capacity = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, items: list, policy_version: int) -> None:
        """Add samples produced by `policy_version`; evicts the oldest ones if the buffer overflows."""
        for item in items:
            self._items.append((int(policy_version), self._next_seq, item))
            self._next_seq += 1
        overflow = len(self._items) - self.capacity
        if overflow > 0:
            self._items.sort(key=lambda e: (e[0], e[1]))
            self._items = self._items[overflow:]
            self.evicted_capacity += overflow

    def evict_stale(self, current_version: int) -> int:
        """Drop items more than `max_staleness` versions older than `current_version`; returns how many."""
        keep = [e for e in self._items if current_version - e[0] <= self.max_staleness]
        dropped = len(self._items) - len(keep)
        self._items = keep
        self.evicted_stale += dropped
        return dropped

    def sample(
        self, n: int, current_version: int, generator: torch.Generator | random.Random | None = None
    ) -> list:
        """Up to `n` distinct items, uniformly without replacement, none staler than `max_staleness`.
        Returns fewer than `n` only if fewer fresh items are held (check `len()` first if it matters)."""
        if n < 0:
            raise ValueError(f"sample size n must be >= 0, got {n}")
        self.evict_stale(current_version)
        k = min(n, len(self._items))
        if isinstance(generator, random.Random):
            picks = generator.sample(range(len(self._items)), k)
        else:
            picks = torch.randperm(len(self._items), generator=generator)[:k].tolist()
        return [self._items[i][2] for i in picks]

    def versions(self) -> list[int]:
        """Policy version of every held item (in storage order)."""
        return [e[0] for e in self._items]

    # ---- checkpointing ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable state. Items must be RolloutGroups or JSON-serialisable values."""
        entries = []
        for idx, (version, seq, item) in enumerate(self._items):
            payload = _encode_item(item, idx)
            entries.append({"policy_version": version, "seq": seq, "item": payload})
        return {
            "capacity": self.capacity,
            "max_staleness": self.max_staleness,
            "eviction": self.eviction,
            "next_seq": self._next_seq,
            "evicted_stale": self.evicted_stale,
            "evicted_capacity": self.evicted_capacity,
            "entries": entries,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("entries", "next_seq"):
            if key not in state:
                raise ReplayStateError(f"replay-buffer state is missing field {key!r}")
        if len(state["entries"]) > self.capacity:
            raise ReplayStateError(
                f"replay-buffer state field entries holds {len(state['entries'])} items but this run's "
                f"capacity is {self.capacity}: raise the capacity to at least that, or start with an empty buffer"
            )
        items = []
        for i, entry in enumerate(state["entries"]):
            try:
                items.append((int(entry["policy_version"]), int(entry["seq"]), _decode_item(entry["item"])))
            except (KeyError, TypeError, ValueError) as exc:
                raise ReplayStateError(
                    f"replay-buffer state field entries[{i}] is malformed: {exc}"
                ) from None
        self._items = items
        self._next_seq = int(state["next_seq"])
        self.evicted_stale = int(state.get("evicted_stale", 0))
        self.evicted_capacity = int(state.get("evicted_capacity", 0))


def _encode_item(item: Any, idx: int) -> Any:
    if isinstance(item, RolloutGroup):
        return {_GROUP_TAG: asdict(item)}
    try:
        return json.loads(json.dumps(item))
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"replay-buffer item {idx} ({type(item).__name__}) is not JSON-serialisable, so it cannot be "
            f"checkpointed: store RolloutGroups or plain dicts/lists ({exc})"
        ) from None


def _decode_item(payload: Any) -> Any:
    if isinstance(payload, dict) and _GROUP_TAG in payload:
        data = dict(payload[_GROUP_TAG])
        data["rollouts"] = [Rollout(**r) for r in data["rollouts"]]
        return RolloutGroup(**data)
    return payload


def split_minibatches(
    n_items: int, updates_per_batch: int, group_size: int = 1, generator: torch.Generator | None = None
) -> list[list[int]]:
    """Split `n_items` sample indices into `updates_per_batch` mini-batches, one per optimizer update.

    Groups of `group_size` consecutive samples (one prompt's rollouts) stay together; mini-batch sizes
    differ by at most one group. With a `generator` the groups are shuffled first.
    Example: 8 items, group_size 2, 3 updates -> groups [0,1],[2,3],[4,5],[6,7] -> sizes 2+1+1 groups.
    """
    if group_size < 1 or n_items % group_size:
        raise ValueError(f"n_items ({n_items}) must be a positive multiple of group_size ({group_size})")
    n_groups = n_items // group_size
    if not 1 <= updates_per_batch <= n_groups:
        raise ValueError(
            f"updates_per_batch must be between 1 and the number of groups ({n_groups}), got {updates_per_batch}"
        )
    order = (
        torch.randperm(n_groups, generator=generator).tolist()
        if generator is not None
        else list(range(n_groups))
    )
    base, extra = divmod(n_groups, updates_per_batch)
    batches, start = [], 0
    for u in range(updates_per_batch):
        size = base + (1 if u < extra else 0)
        groups = order[start : start + size]
        batches.append([g * group_size + j for g in groups for j in range(group_size)])
        start += size
    return batches
