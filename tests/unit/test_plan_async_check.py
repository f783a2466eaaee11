"""`bapo-nemo check` refuses the async GRPO configs NeMo-RL or our hooks cannot run, naming the key and the
fix, and the driver's pre-flight refuses them before Ray starts, without NeMo-RL."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from bapo_nemo.plan.check_cli import configure_parser, run_check
from bapo_nemo.plan.rules.config_io import load_nemo_config
from tests.support.presets import ASYNC_32B

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
def _args(config, nodes, gpn, *overrides):
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args([str(config), *overrides, "--nodes", str(nodes), "--gpus-per-node", str(gpn)])


def _errors(findings) -> dict[str, str]:
    return {f.key: f.message for f in findings if f.level == "error"}


@pytest.mark.parametrize(
    "config,overrides,key,fragment",
    [
        # NeMo-RL's async loop refuses colocated inference and a synchronous vLLM engine
        ("bapo_32b.yaml", ["grpo.async_grpo.enabled=true"], "policy.generation.colocated.enabled",
         "dedicated generation GPUs"),
        ("bapo_32b.yaml", ["grpo.async_grpo.enabled=true"], "policy.generation.vllm_cfg.async_engine",
         "set policy.generation.vllm_cfg.async_engine=true"),
        # in-flight updates without the async engine
        ("bapo_32b.yaml", [*ASYNC_32B, "policy.generation.vllm_cfg.async_engine=false"],
         "policy.generation.vllm_cfg.async_engine", "its in_flight_weight_updates need the async vLLM engine"),
        # the partial-rollout hook wraps the synchronous loop only
        ("bapo_32b_64k.yaml", [*ASYNC_32B, "policy.megatron_cfg.context_parallel_size=4"], "partial_rollouts",
         "remove the partial_rollouts block, or set grpo.async_grpo.enabled=false"),
        ("bapo_32b.yaml", [*ASYNC_32B, "grpo.async_grpo.max_trajectory_age_steps=0"],
         "grpo.async_grpo.max_trajectory_age_steps", "an int >= 1"),
    ],
)
def test_async_configs_that_cannot_run_are_errors(config, overrides, key, fragment, monkeypatch):
    """`check` names the key and the fix; the driver's pre-flight (which runs before Ray starts) refuses the
    same config with NeMo-RL absent: `nemo_rl` is made unimportable here."""
    _, findings, _, _ = run_check(_args(CONFIGS / config, 8, 8, *overrides))
    assert fragment in _errors(findings).get(key, ""), _errors(findings)

    monkeypatch.setitem(sys.modules, "nemo_rl", None)  # any import of it raises
    from bapo_nemo.nemo.driver import DriverConfigError, preflight, raise_on_errors

    with pytest.raises(DriverConfigError) as info:
        raise_on_errors(preflight(load_nemo_config(CONFIGS / config, overrides)))
    assert f"{key}: " in str(info.value) and fragment in str(info.value)
