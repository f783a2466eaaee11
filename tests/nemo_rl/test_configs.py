"""The shipped NeMo-RL configs against the NeMo-RL under test: every key of its Megatron example, the
shipped key list regenerated from its source, the `loss_fn` section building BAPOLossFn, and its own
MasterConfig validating each config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bapo_nemo.plan.rules.config_io import load_nemo_config
from bapo_nemo.plan.rules.nemo_rl_keys import key_paths
from bapo_nemo.plan.rules.schema import known_keys
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.presets import NEMO_PRESETS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"




# ---- against v0.7.0 --------------------------------------------------------------------------------
def _examples_dir() -> Path:
    import nemo_rl

    path = Path(nemo_rl.__file__).resolve().parents[1] / "examples" / "configs"
    if not path.is_dir():
        pytest.skip(f"NeMo-RL's examples/configs not next to the package ({path})")
    return path


@pytest.mark.parametrize("name", NEMO_PRESETS)
def test_configs_have_every_key_of_the_megatron_example(name):
    """Every key the installed NeMo-RL's own Megatron GRPO example (grpo_math_8B_megatron.yaml, inheritance
    resolved by its loader) sets exists in ours, except sections we replace on purpose and keys only one of
    the tested NeMo-RL trees knows (a preset must run on both: main's required validation sampling keys are
    filled by the driver, bapo_nemo/nemo/installed.py)."""
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    theirs = OmegaConf.to_container(
        load_config(_examples_dir() / "grpo_math_8B_megatron.yaml"), resolve=False
    )
    ours = load_nemo_config(CONFIGS / name)
    replaced = (
        "policy.dtensor_cfg.",
        "policy.optimizer.",
        "policy.scheduler.",
        "data.train.",
        "data.validation.",
    )
    in_both = known_keys("v0.7.0") & known_keys("main")
    missing = sorted(p for p in key_paths(theirs) - key_paths(ours) if not p.startswith(replaced) and p in in_both)
    assert missing == []


def test_a_shipped_key_list_is_exactly_the_installed_nemo_rls():
    """bapo_nemo/plan/rules/nemo_rl_*_keys.json (what `bapo-nemo check` uses without nemo_rl) is what
    bapo_nemo/plan/rules/nemo_rl_keys.py makes from the NeMo-RL tree under test, plus the list's carried keys:
    each tested tree's list can be made again, and it holds every key of that tree's types and examples."""
    import json
    from importlib import resources

    import nemo_rl

    from bapo_nemo.plan.rules.nemo_rl_keys import keys_of_tree
    from bapo_nemo.plan.rules.schema import SCHEMAS

    tree = keys_of_tree(Path(nemo_rl.__file__).resolve().parents[1])
    matches = []
    for schema, file in SCHEMAS.items():
        if file is None:
            continue
        shipped = json.loads(resources.files("bapo_nemo.plan.rules").joinpath(file).read_text())
        if set(shipped["keys"]) == tree | set(shipped["carried"]):
            matches.append(schema)
    assert len(matches) == 1, f"no shipped key list is this NeMo-RL's ({nemo_rl.__file__}): regenerate it"


@pytest.mark.parametrize("name", NEMO_PRESETS)
def test_loss_fn_section_builds_bapo_loss(name):
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig

    from bapo_nemo.nemo.loss import BAPOLossFn

    cfg = load_nemo_config(CONFIGS / name)
    fn = BAPOLossFn(ClippedPGLossConfig(**cfg["loss_fn"]))
    assert fn.options.bapo.enabled and fn.options.ratio_reference == "behavior"
    assert fn.options.bapo.c_high_max == 3.0 and fn.reference_policy_kl_penalty == 0


_MASTER_CONFIG_SCRIPT = """
import sys, typing
if sys.version_info < (3, 12):
    # pydantic only accepts typing_extensions.TypedDict before 3.12; the container (3.13) needs nothing
    import typing_extensions
    typing.TypedDict = typing_extensions.TypedDict
from nemo_rl.algorithms.grpo import MasterConfig
from bapo_nemo.nemo.installed import fill_validation_sampling, required_generation_keys
from bapo_nemo.nemo.partial_rollout import install_partial_rollouts
from bapo_nemo.plan.rules.config_io import load_nemo_config
for path in sys.argv[1:]:
    config = load_nemo_config(path)
    fill_validation_sampling(config, required_generation_keys())  # as the driver does before MasterConfig
    mc = MasterConfig(**config)
    assert mc.loss_fn.model_extra["bapo"]["rho0"] == 0.4, "the bapo block must survive validation"
    block = (mc.model_extra or {}).get("partial_rollouts")
    if block is not None:  # the shipped block installs as the driver installs it
        max_new = mc.policy["generation"]["max_new_tokens"]
        hook = install_partial_rollouts(mc, patch_grpo=False)
        assert mc.policy["generation"]["max_new_tokens"] == block["token_budget"], path
        assert hook.response_cap == max_new and hook.prefill_batches == block["prefill_batches"], path
        assert hook.config.max_segments * hook.config.token_budget >= hook.response_cap, "cut before the cap"
        hook.uninstall()
print("ok")
"""


def test_master_config_validates():
    """The installed MasterConfig (pydantic) accepts our configs as the driver hands them over (main's required
    validation sampling keys filled) and keeps loss_fn.bapo (extra="allow"); the
    presets' partial_rollouts blocks install on it (budget, response cap, pool; no response cut early).
    In a subprocess: on Python < 3.12 it patches typing.TypedDict, which must not leak into other tests."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _MASTER_CONFIG_SCRIPT, *(str(CONFIGS / n) for n in NEMO_PRESETS)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
