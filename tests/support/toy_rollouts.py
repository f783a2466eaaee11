"""Two tiny, real generators that drive the partial-rollout tests (they are the boundary a model sits at).

- `CountdownGenerator`: fully predictable, for hand-computed expectations. A prompt `[L0, dL]` asks sample
  k of a group for a response of L0 + k*dL tokens; token j of sample k is 1000 + 100*k + j and its
  log-prob is -0.01*(j+1).
- `ToyPolicy`: a seeded stochastic policy. The next-token distribution is a softmax over a small vocabulary
  whose logits depend on (seed, policy version, last token); sampling uses an RNG keyed by (seed, version,
  context, occurrence), so a run is reproducible and a continuation depends only on the re-fed context.
Both log every call so tests can check that no generated token is lost or duplicated.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

from bapo_nemo.rollout import GenerationChunk


def _occurrences(contexts: list[list[int]]) -> list[int]:
    """k-th time an identical context appears in one call (samples of a group share their prompt)."""
    seen: dict[tuple, int] = defaultdict(int)
    out = []
    for c in contexts:
        out.append(seen[tuple(c)])
        seen[tuple(c)] += 1
    return out


class CountdownGenerator:
    def __init__(self, prompt_len: int = 2):
        self.prompt_len = prompt_len
        self.calls: list[tuple[int, list[list[int]], int]] = []  # (version, contexts, max_new_tokens)
        self.version = 0

    def bind(self, version: int):
        self.version = version
        return self

    def __call__(self, contexts: list[list[int]], max_new_tokens: int) -> list[GenerationChunk]:
        self.calls.append((self.version, [list(c) for c in contexts], max_new_tokens))
        chunks = []
        for ctx, occ in zip(contexts, _occurrences(contexts)):
            l0, dl = ctx[0], ctx[1]
            response = ctx[self.prompt_len :]
            k = (response[0] - 1000) // 100 if response else occ
            target = l0 + k * dl
            start = len(response)
            n = min(max_new_tokens, target - start)
            tokens = [1000 + 100 * k + j for j in range(start, start + n)]
            logprobs = [-0.01 * (j + 1) for j in range(start, start + n)]
            chunks.append(GenerationChunk(tokens, logprobs, finished=start + n == target))
        return chunks


class ToyPolicy:
    def __init__(self, seed: int, vocab_size: int = 6, eos_id: int = 0, eos_logit_bias: float = 0.0):
        self.seed, self.vocab_size, self.eos_id, self.eos_bias = seed, vocab_size, eos_id, eos_logit_bias
        self.version = 0
        # every chunk ever produced: (version, context, tokens, logprobs, finished)
        self.log: list[tuple[int, tuple[int, ...], list[int], list[float], bool]] = []

    def bind(self, version: int) -> ToyPolicy:
        self.version = version
        return self

    def log_probs(self, version: int, last_token: int) -> list[float]:
        rng = random.Random(f"logits/{self.seed}/{version}/{last_token}")
        logits = [rng.gauss(0.0, 1.0) for _ in range(self.vocab_size)]
        logits[self.eos_id] += self.eos_bias
        m = max(logits)
        lse = m + math.log(sum(math.exp(x - m) for x in logits))
        return [x - lse for x in logits]

    def __call__(self, contexts: list[list[int]], max_new_tokens: int) -> list[GenerationChunk]:
        chunks = []
        for ctx, occ in zip(contexts, _occurrences(contexts)):
            rng = random.Random(f"sample/{self.seed}/{self.version}/{tuple(ctx)}/{occ}")
            tokens, logprobs, finished, last = [], [], False, ctx[-1]
            for _ in range(max_new_tokens):
                lp = self.log_probs(self.version, last)
                token = rng.choices(range(self.vocab_size), weights=[math.exp(x) for x in lp])[0]
                tokens.append(token)
                logprobs.append(lp[token])
                last = token
                if token == self.eos_id:
                    finished = True
                    break
            self.log.append((self.version, tuple(ctx), tokens, logprobs, finished))
            chunks.append(GenerationChunk(tokens, logprobs, finished))
        return chunks


# ---- the generators themselves ----------------------------------------------------------------------
