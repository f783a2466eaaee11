"""Which policy produced each token when weights change while a response is generated (async GRPO with
in-flight weight updates); NeMo-RL records one version per trajectory, the one at its start.

- `VersionTracker`, beside a generation engine: per finished request, runs `[[first_token_index,
  updates_applied], ...]`, keyed by a fingerprint of (prompt tokens, response tokens).
- `VersionIndex`, on the trainer's side: joins them with a batch's rows as spans `[[length, update_count],
  ...]`, UNKNOWN (-1) where no record matches. Free of NeMo-RL and vLLM; docs/nemo_rl.md has the metrics.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

UNKNOWN = -1


def fingerprint(prompt_ids: Sequence[int] | np.ndarray, token_ids: Sequence[int] | np.ndarray) -> str:
    """A key for one generated segment: its context and its tokens (ids as little-endian 64-bit integers,
    so lists on an engine and tensors on the trainer give the same key)."""
    prompt, tokens = np.asarray(prompt_ids, dtype="<i8"), np.asarray(token_ids, dtype="<i8")
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.asarray([prompt.size], dtype="<i8").tobytes())
    digest.update(prompt.tobytes())
    digest.update(tokens.tobytes())
    return digest.hexdigest()


def spans(runs: Sequence[Sequence[int]], n_tokens: int) -> list[list[int]]:
    """Runs `[[first_index, value], ...]` over n tokens as spans `[[length, value], ...]`."""
    ends = [start for start, _ in runs[1:]] + [n_tokens]
    return [[min(end, n_tokens) - start, value] for (start, value), end in zip(runs, ends) if end > start]


@dataclass
class _Live:
    prompt_ids: list[int]
    seen: int = 0  # tokens streamed so far
    runs: list[list[int]] = field(default_factory=list)


class VersionTracker:
    """Per-token weight-update counts for the requests of one engine.

    `started(request, prompt_ids)` when a request is submitted, `streamed(request, n)` with the request's
    cumulative token count at every streamed output, `finished(request, token_ids)` at its end. Around a
    weight update: `update_sent()` when it is sent, `generated_at_update(counts)` with what the engine had
    generated per request when it applied it, then `update_applied()`, or `update_failed()`.

    A request's boundary is the engine's count where the engine gave one: exact, as the engine applies an
    update between two of its steps. A request the engine no longer held had finished before the update
    if any of its tokens had streamed (all on the old weights); else it had not started (all on the new
    ones; a request that ran whole while its stream was not read is the one misread case). Without the
    engine's counts the boundary is what had streamed when the update was sent: tokens produced before
    it but still in transit count one update newer.
    """

    def __init__(self) -> None:
        self.updates = 0
        self._live: dict[str, _Live] = {}
        self._pending: dict[str, int] | None = None
        self._generated: dict[str, int] | None = None
        self._done: list[dict] = []

    def started(self, request: str, prompt_ids: Sequence[int]) -> None:
        self._live[request] = _Live(list(prompt_ids), runs=[[0, self.updates]])

    def streamed(self, request: str, n_tokens: int) -> None:
        live = self._live.get(request)
        if live is not None:
            live.seen = max(live.seen, n_tokens)

    def finished(self, request: str, token_ids: Sequence[int]) -> None:
        live = self._live.pop(request, None)
        if live is None:
            return
        runs = [run for run in live.runs if run[0] < len(token_ids)] or [[0, live.runs[-1][1]]]
        self._done.append({"key": fingerprint(live.prompt_ids, token_ids), "runs": _merged(runs)})

    def abandoned(self, request: str) -> None:
        self._live.pop(request, None)

    def update_sent(self) -> None:
        self._pending = {request: live.seen for request, live in self._live.items()}
        self._generated = None

    def generated_at_update(self, generated: dict[str, int]) -> None:
        """The engine's generated-token count per request it held when it applied the update. Its request
        ids may carry a suffix the engine added to ours (vLLM: `<ours>-<8 characters>`)."""
        self._generated = {}
        for engine_id, count in generated.items():
            ours = engine_id if engine_id in self._live else engine_id.rsplit("-", 1)[0]
            if ours in self._live:
                self._generated[ours] = int(count)

    def update_applied(self) -> None:
        self.updates += 1
        for request, live in self._live.items():
            boundary = self._boundary(request, live)
            if boundary is not None:
                live.runs.append([boundary, self.updates])
        self._pending = self._generated = None

    def _boundary(self, request: str, live: _Live) -> int | None:
        """Where the update's tokens start in this request; None: none of its tokens are on it."""
        if self._generated is None:  # a request started during the transfer is counted on the new weights
            return (self._pending or {}).get(request, 0)
        if request in self._generated:
            return self._generated[request]
        return None if live.seen else 0

    def update_failed(self) -> None:
        self._pending = self._generated = None

    def take(self) -> dict:
        """The finished requests' records since the last take, and the updates applied so far."""
        done, self._done = self._done, []
        return {"updates": self.updates, "records": done}


def _merged(runs: list[list[int]]) -> list[list[int]]:
    """Runs with a later run at the same start replacing the earlier one, and equal neighbours merged."""
    out: list[list[int]] = []
    for start, value in runs:
        if out and out[-1][0] == start:
            out.pop()
        if not out or out[-1][1] != value:
            out.append([start, value])
    return out


class VersionIndex:
    """The trainer's side: records from every engine, joined with training rows. Identical segments (GRPO
    samples of one prompt often coincide) are kept as a multiset: each matching row takes one of them, so
    the step's token ages are exact even where which of the identical rows got which record is not."""

    def __init__(self) -> None:
        self._runs: dict[str, list[list[list[int]]]] = defaultdict(list)

    def __len__(self) -> int:
        return sum(len(records) for records in self._runs.values())

    def add(self, records: Iterable[dict]) -> None:
        for record in records:
            self._runs[record["key"]].append(record["runs"])

    def _take(self, key: str) -> list[list[int]] | None:
        records = self._runs.get(key)
        if not records:
            return None
        runs = records.pop(0)
        if not records:
            del self._runs[key]
        return runs

    def row_spans(self, input_ids: np.ndarray, token_mask: np.ndarray) -> list[list[int]]:
        """One row's generated tokens, in order, as spans `[[length, update_count], ...]` (UNKNOWN for a
        segment without a record). Segments are the maximal runs of `token_mask`; a matched record is
        consumed."""
        mask = np.asarray(token_mask).astype(bool)
        edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
        out: list[list[int]] = []
        for start, end in zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()):
            runs = self._take(fingerprint(input_ids[:start], input_ids[start:end]))
            for length, value in spans(runs, end - start) if runs is not None else [[end - start, UNKNOWN]]:
                if out and out[-1][1] == value:
                    out[-1][0] += length
                else:
                    out.append([length, value])
        return out

    def forget_older_than(self, oldest_update: int) -> None:
        """Drop records whose newest tokens predate `oldest_update` (their responses will not be trained:
        the replay buffer drops trajectories past the age limit)."""
        for key in list(self._runs):
            self._runs[key] = [r for r in self._runs[key] if r[-1][1] >= oldest_update]
            if not self._runs[key]:
                del self._runs[key]


@dataclass(frozen=True)
class TokenAges:
    """Staleness of one training batch, per generated token (policy versions behind the trained one)."""

    mean: float
    max: int
    mixed_response_frac: float  # responses whose tokens come from more than one policy
    known_token_frac: float  # generated tokens whose version was recorded

    def metrics(self) -> dict[str, float]:
        return {
            "token_age_mean": self.mean,
            "token_age_max": float(self.max),
            "mixed_version_response_frac": self.mixed_response_frac,
            "token_version_known_frac": self.known_token_frac,
        }


def token_ages(rows: Sequence[Sequence[Sequence[int]]], trained_version: int) -> TokenAges:
    """`rows`: each response's generated tokens as spans `[[length, policy_version], ...]` (UNKNOWN where
    not recorded); ages are `trained_version - policy_version`, weighted by tokens."""
    known = generated = age_sum = mixed = 0
    oldest = 0
    for row in rows:
        versions = {version for length, version in row if version != UNKNOWN and length > 0}
        mixed += len(versions) > 1
        for length, version in row:
            generated += length
            if version != UNKNOWN:
                known += length
                age_sum += length * (trained_version - version)
                oldest = max(oldest, trained_version - version) if length else oldest
    return TokenAges(
        mean=age_sum / known if known else float("nan"),
        max=oldest,
        mixed_response_frac=mixed / len(rows) if rows else float("nan"),
        known_token_frac=known / generated if generated else float("nan"),
    )
