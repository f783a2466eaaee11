"""The shipped NeMo-RL configs through the driver's preflight on the package's Python, and their keys against
both tested trees' shipped key lists (against the installed NeMo-RL itself: tests/nemo_rl/test_configs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bapo_nemo.nemo.driver import DriverConfigError, preflight, raise_on_errors
from bapo_nemo.plan.rules.config_io import load_nemo_config
from tests.support.presets import NEMO_PRESETS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


# ---- CPU: the driver refuses what `bapo-nemo check` refuses ---------------------------------------
@pytest.mark.parametrize("name", NEMO_PRESETS)
def test_driver_preflight_accepts_shipped_configs(name):
    findings = preflight(load_nemo_config(CONFIGS / name))
    raise_on_errors(findings)  # no error


def test_driver_preflight_refuses_unfused_packed_loss():
    config = load_nemo_config(CONFIGS / "bapo_32b.yaml", ["policy.sequence_packing.fuse_loss=false"])
    with pytest.raises(DriverConfigError, match="policy.sequence_packing.fuse_loss: .*set it true"):
        raise_on_errors(preflight(config))


@pytest.mark.parametrize("schema", ["v0.7.0", "main"])
@pytest.mark.parametrize("name", NEMO_PRESETS)
def test_presets_are_valid_under_both_tested_nemo_rl_trees(name, schema):
    from bapo_nemo.plan.rules.schema import unknown_keys

    assert unknown_keys(load_nemo_config(CONFIGS / name), schema) == []


def test_a_key_of_the_other_release_is_refused_naming_where_it_belongs():
    from bapo_nemo.plan.rules.schema import unknown_keys

    config = load_nemo_config(CONFIGS / "bapo_7b.yaml", ["++policy.generation.val_temperature=0.6"])
    (unknown,) = unknown_keys(config, "v0.7.0")
    assert unknown.path == "policy.generation.val_temperature"
    assert unknown.message() == (
        "not a NeMo-RL v0.7.0 config key: it is NeMo-RL main's (check against the NeMo-RL the job runs: "
        "--nemo-rl main, or remove it)"
    )
    assert unknown_keys(config, "main") == []
    typo = load_nemo_config(CONFIGS / "bapo_7b.yaml", ["++policy.generation.val_temprature=0.6"])
    assert "did you mean policy.generation.val_temperature?" in unknown_keys(typo, "main")[0].message()


def test_driver_without_nemo_rl_says_where_to_run(monkeypatch):
    """Outside the container the driver stops with the fix, not a traceback. nemo_rl is hidden for the
    test (a None entry in sys.modules makes its import fail) so it behaves the same everywhere."""
    from bapo_nemo.nemo.driver import main

    monkeypatch.setitem(sys.modules, "nemo_rl", None)
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms", None)
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.grpo", None)
    with pytest.raises(SystemExit, match=r"nvcr.io/nvidia/nemo-rl:v0.7.0"):
        main(["--config", str(CONFIGS / "bapo_7b.yaml")])
