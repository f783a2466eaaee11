"""Where the installed async loop samples before its first refit (v0.7.0: vLLM still holds the dummy
weights NeMo-RL trains with), the driver refits first: the answer of `async_collects_before_first_refit`
is the order in the installed loop's source."""

from __future__ import annotations

import inspect


def test_the_installed_answer_is_the_order_in_its_source():
    from nemo_rl.algorithms import grpo

    from bapo_nemo.nemo.installed import async_collects_before_first_refit

    source = inspect.getsource(grpo.async_grpo_train)
    expected = source.index(".start_collection.remote(") < source.index("refit_policy_generation(")
    assert async_collects_before_first_refit() is expected
