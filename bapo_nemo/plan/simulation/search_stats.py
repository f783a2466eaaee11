"""How many responses one BAPO bound search sees on a NeMo-RL v0.7.0 cluster config.

`microbatch`: one search per micro-batch, summed over the DP group (with packing, DP bins of
`train_mb_tokens`, dealt as v0.7.0's `shard_by_batch_size` does); `step`: the whole optimizer step.
Lengths, rewards and advantages are drawn from a length and a pass-rate model; a search is *one-sided*
when it sees no positive or no negative advantage. Details: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Long chain-of-thought math (R1-distilled models on DAPO-Math/AIME-style prompts): median response
# ~9k tokens, a heavy right tail (sigma 0.8: mean ~12k, ~5% of responses hit a 32k cap), prompts ~150.
DEFAULT_RESPONSE_MEDIAN = 9000.0
DEFAULT_RESPONSE_SIGMA = 0.8
DEFAULT_PROMPT_TOKENS = 150
# Pass rate across prompts ~ Beta(1, 1) (uniform): about 12% of 16-sample groups are all right or all
# wrong, in line with the share of zero-advantage groups dynamic sampling reports on DAPO-Math.
DEFAULT_PASS_RATE_BETA = (1.0, 1.0)

# Below this many responses per search, the warning fires (docs/nemo_rl.md, "How many responses one
# search sees", gives the evidence): the embedded study measures the bounds' spread and saturation as
# a function of responses per search, and one-sided searches must stay rare.
MIN_RESPONSES_PER_SEARCH = 32
MAX_ONE_SIDED_SHARE = 0.01


class LengthModelError(ValueError):
    """Bad response-length input; the message names the option or file and the fix."""


@dataclass(frozen=True)
class LengthModel:
    """Response lengths in tokens: log-normal(median, sigma) truncated at max_tokens, or an empirical
    sample (drawn with replacement; each value also capped at max_tokens)."""

    max_tokens: int
    median: float = DEFAULT_RESPONSE_MEDIAN
    sigma: float = DEFAULT_RESPONSE_SIGMA
    empirical: tuple[int, ...] | None = None

    def draw(self, rng: random.Random) -> int:
        if self.empirical:
            return max(1, min(self.max_tokens, rng.choice(self.empirical)))
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(self.median), self.sigma))))


def read_lengths(path: str | Path) -> tuple[int, ...]:
    """One response length (tokens) per line; blank lines and '#' comments are skipped."""
    values = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            v = int(float(text))
        except ValueError:
            raise LengthModelError(
                f"{path}:{n}: {text!r} is not a token count (one integer per line)"
            ) from None
        if v <= 0:
            raise LengthModelError(f"{path}:{n}: response length must be > 0, got {v}")
        values.append(v)
    if not values:
        raise LengthModelError(f"{path}: no response lengths found (one integer per line)")
    return tuple(values)


@dataclass(frozen=True)
class SearchShape:
    """The batch shape that decides what a search sees (all counts in responses or tokens)."""

    global_batch: int  # policy.train_global_batch_size
    group_size: int  # grpo.num_generations_per_prompt
    dp: int  # data-parallel size
    bin_tokens: int | None  # sequence_packing.train_mb_tokens; None: no packing
    micro_batch_size: int  # policy.train_micro_batch_size (sequences per micro-batch without packing)
    pad_multiple: int = 1  # each sequence's length is rounded up to this before packing
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    granularity: str = "microbatch"


@dataclass(frozen=True)
class SearchStats:
    searches: int  # searches simulated
    responses_mean: float
    responses_p10: float
    responses_median: float
    responses_p90: float
    groups_mean: float  # distinct prompt groups per search
    one_sided: float  # share of searches that see one advantage sign (or none)
    no_signal: float  # share of searches whose responses all have zero advantage


def first_fit_decreasing(
    lengths: Sequence[int], capacity: int, min_bins: int, multiple: int
) -> list[list[int]]:
    """Bins of indices: longest first into the first bin with room; then empty bins are added until there
    are at least `min_bins` and a multiple of `multiple` (v0.7.0 does the same so every DP rank gets the
    same number of micro-batches)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > capacity:
            raise LengthModelError(
                f"a {lengths[i]}-token sequence exceeds the packing bin of {capacity} tokens "
                "(policy.sequence_packing.train_mb_tokens): raise it to max_total_sequence_length"
            )
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    while len(bins) < min_bins or len(bins) % multiple:
        bins.append([])
    return bins


def searches_of_global_batch(lengths: Sequence[int], shape: SearchShape) -> list[list[int]]:
    """The response indices each bound search of one global batch sees (v0.7.0's micro-batching)."""
    n = len(lengths)
    if shape.granularity == "step":
        return [list(range(n))]
    if shape.bin_tokens is not None:
        padded = [-(-(x + shape.prompt_tokens) // shape.pad_multiple) * shape.pad_multiple for x in lengths]
        bins = first_fit_decreasing(padded, shape.bin_tokens, shape.dp, shape.dp)
    else:  # fixed micro-batches: contiguous shards of the global batch, then mbs rows at a time
        per_rank = n // shape.dp
        bins = []
        for j in range(0, per_rank, shape.micro_batch_size):
            for rank in range(shape.dp):
                start = rank * per_rank + j
                bins.append(list(range(start, min(start + shape.micro_batch_size, (rank + 1) * per_rank))))
    return [[i for b in bins[j : j + shape.dp] for i in b] for j in range(0, len(bins), shape.dp)]


def simulate(
    shape: SearchShape,
    lengths: LengthModel,
    pass_rate_beta: tuple[float, float] = DEFAULT_PASS_RATE_BETA,
    global_batches: int = 200,
    seed: int = 0,
) -> SearchStats:
    """Monte-Carlo over `global_batches` global batches of complete prompt groups."""
    rng = random.Random(seed)
    groups_per_batch = max(1, shape.global_batch // shape.group_size)
    counts, groups_seen, one_sided, no_signal = [], [], 0, 0
    for _ in range(global_batches):
        lens, group_of, sign = [], [], []
        for g in range(groups_per_batch):
            p = rng.betavariate(*pass_rate_beta)
            glens = [lengths.draw(rng) for _ in range(shape.group_size)]
            rewards = [0.0 if x >= lengths.max_tokens else float(rng.random() < p) for x in glens]
            mean = sum(rewards) / len(rewards)
            lens += glens
            group_of += [g] * shape.group_size
            sign += [(r > mean) - (r < mean) for r in rewards]
        for search in searches_of_global_batch(lens, shape):
            if not search:
                continue
            counts.append(len(search))
            groups_seen.append(len({group_of[i] for i in search}))
            signs = {sign[i] for i in search}
            one_sided += not (1 in signs and -1 in signs)
            no_signal += signs == {0}
    counts.sort()
    k = len(counts)

    def q(x: float) -> float:
        return float(counts[min(k - 1, int(x * k))])

    return SearchStats(
        searches=k,
        responses_mean=sum(counts) / k,
        responses_p10=q(0.10),
        responses_median=q(0.50),
        responses_p90=q(0.90),
        groups_mean=sum(groups_seen) / k,
        one_sided=one_sided / k,
        no_signal=no_signal / k,
    )


def too_few(stats: SearchStats) -> bool:
    """The warning rule (thresholds justified in docs/nemo_rl.md)."""
    return stats.responses_median < MIN_RESPONSES_PER_SEARCH or stats.one_sided > MAX_ONE_SIDED_SHARE


def length_moments(lengths: LengthModel, prompt_tokens: int, n: int = 20000, seed: int = 0) -> tuple[float, float]:
    """E[s] and E[s^2] of whole sequences (prompt + response), s in tokens, by sampling."""
    rng = random.Random(seed)
    seqs = [prompt_tokens + lengths.draw(rng) for _ in range(n)]
    return sum(seqs) / n, sum(s * s for s in seqs) / n
