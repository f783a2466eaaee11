"""Where the installed async loop samples before its first refit (v0.7.0: vLLM still holds the dummy
weights NeMo-RL trains with), the driver refits first. The decision is read from the loop's source;
the async e2e test (tests/nemo_rl/test_driver_e2e.py) checks no request was sampled before a refit."""

from __future__ import annotations

from bapo_nemo.nemo.installed import collects_before_refit

V070_ORDER = '''
def async_grpo_train(policy, policy_generation):
    collection_task = trajectory_collector.start_collection.remote(dataloader)
    if NEED_REFIT:
        refit_policy_generation(policy, policy_generation, colocated_inference)
'''
MAIN_ORDER = '''
def async_grpo_train(policy, policy_generation):
    if POLICY_GENERATION_STALE:
        refit_policy_generation(policy, policy_generation, colocated_inference)
    ray.get(trajectory_collector.set_weight_version.remote(weight_version))
    trajectory_collector.start_collection.remote(dataloader)
'''


def test_the_order_of_the_two_calls_decides():
    assert collects_before_refit(V070_ORDER) is True
    assert collects_before_refit(MAIN_ORDER) is False
    # a loop whose collector starts another way: the extra refit is kept (harmless)
    assert collects_before_refit(MAIN_ORDER.replace("start_collection", "run")) is True


