"""The two toy generators of the partial-rollout tests (tests/support/toy_rollouts.py) do what they promise."""

from __future__ import annotations

import math

from tests.support.toy_rollouts import CountdownGenerator, ToyPolicy


def test_countdown_generator_is_hand_predictable():
    gen = CountdownGenerator()
    # prompt [3, 2]: sample 0 wants 3 tokens, sample 1 wants 3 + 2 = 5.
    first = gen([[3, 2], [3, 2]], 2)
    assert [c.token_ids for c in first] == [[1000, 1001], [1100, 1101]]
    assert first[0].logprobs == [-0.01, -0.02]
    assert [c.finished for c in first] == [False, False]
    second = gen([[3, 2, 1000, 1001], [3, 2, 1100, 1101]], 2)
    assert [c.token_ids for c in second] == [[1002], [1102, 1103]]
    assert [c.finished for c in second] == [True, False]


def test_toy_policy_log_probs_normalise_and_sampling_is_reproducible():
    policy = ToyPolicy(seed=3)
    lp = policy.log_probs(version=0, last_token=2)
    assert math.isclose(sum(math.exp(x) for x in lp), 1.0, rel_tol=1e-12)
    a = ToyPolicy(seed=3).bind(1)([[1, 2], [1, 2]], 5)
    b = ToyPolicy(seed=3).bind(1)([[1, 2], [1, 2]], 5)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    # a different policy version is a different distribution
    assert ToyPolicy(seed=3).log_probs(0, 2) != ToyPolicy(seed=3).log_probs(1, 2)
    # every log-prob reported is the sampler's own for the token it chose
    for chunk in a:
        last = 2
        for t, x in zip(chunk.token_ids, chunk.logprobs):
            assert x == policy.log_probs(1, last)[t]
            last = t
