"""Our NeMo-RL configs against v0.7.0 itself (needs nemo_rl importable; skips in CI), plus the driver's
preflight on CPU.

Set-up used on a CPU machine: the v0.7.0 tree on PYTHONPATH, its light dependencies installed (see
docs/nemo_rl.md, "Testing against NeMo-RL on a CPU machine")."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

import pytest

from bapo_nemo.nemo.driver import DriverConfigError, preflight, raise_on_errors
from bapo_nemo.plan.config_io import load_nemo_config
from bapo_nemo.plan.schema import known_keys
from tests.hang_guard import HANG_GUARD_S

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
OURS = ["bapo_7b.yaml", "bapo_32b.yaml", "bapo_32b_64k.yaml", "bapo_32b_partial.yaml"]


# ---- CPU: the driver refuses what `bapo-nemo check` refuses ---------------------------------------
@pytest.mark.parametrize("name", OURS)
def test_driver_preflight_accepts_shipped_configs(name):
    findings = preflight(load_nemo_config(CONFIGS / name))
    raise_on_errors(findings)  # no error


def test_driver_preflight_refuses_unfused_packed_loss():
    config = load_nemo_config(CONFIGS / "bapo_32b.yaml", ["policy.sequence_packing.fuse_loss=false"])
    with pytest.raises(DriverConfigError, match="policy.sequence_packing.fuse_loss: .*set it true"):
        raise_on_errors(preflight(config))


# ---- against v0.7.0 --------------------------------------------------------------------------------
def _examples_dir() -> Path:
    import nemo_rl

    path = Path(nemo_rl.__file__).resolve().parents[1] / "examples" / "configs"
    if not path.is_dir():
        pytest.skip(f"NeMo-RL's examples/configs not next to the package ({path})")
    return path


def _paths(node, prefix=""):
    out = set()
    if isinstance(node, dict):
        for k, v in node.items():
            p = f"{prefix}.{k}" if prefix else str(k)
            out.add(p)
            out |= _paths(v, p)
    return out


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", OURS)
def test_configs_have_every_key_of_the_v070_megatron_example(name):
    """Every key NeMo-RL's own Megatron GRPO example (grpo_math_8B_megatron.yaml, inheritance resolved by
    v0.7.0's loader) sets exists in ours, except sections we replace on purpose."""
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
    missing = sorted(p for p in _paths(theirs) - _paths(ours) if not p.startswith(replaced))
    assert missing == []


def _typed_dict_keys(tp, prefix, out, depth=0):
    if depth > 6:
        return
    if typing.is_typeddict(tp):
        for k, v in typing.get_type_hints(tp).items():
            out.add(f"{prefix}.{k}")
            _typed_dict_keys(v, f"{prefix}.{k}", out, depth + 1)
        return
    for arg in typing.get_args(tp):
        _typed_dict_keys(arg, prefix, out, depth + 1)


@pytest.mark.nemo_rl
def test_shipped_key_list_covers_v070_typed_dicts():
    """bapo_nemo/plan/nemo_rl_v070_keys.json (what `bapo-nemo check` uses without nemo_rl) knows every
    key of the installed NeMo-RL's config TypedDicts and of ClippedPGLossConfig."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig
    from nemo_rl.distributed.virtual_cluster import ClusterConfig
    from nemo_rl.models.policy import PolicyConfig
    from nemo_rl.utils.checkpoint import CheckpointingConfig
    from nemo_rl.utils.logger import LoggerConfig

    from bapo_nemo.plan.schema import _skipped

    keys: set[str] = {f"loss_fn.{k}" for k in ClippedPGLossConfig.model_fields}
    for name, td in (
        ("policy", PolicyConfig),
        ("logger", LoggerConfig),
        ("checkpointing", CheckpointingConfig),
        ("cluster", ClusterConfig),
    ):
        _typed_dict_keys(td, name, keys)
    # policy.scheduler is a YAML list of scheduler dicts: the key check does not walk into lists.
    missing = sorted(
        k for k in keys if not _skipped(k) and k not in known_keys() and not k.startswith("policy.scheduler.")
    )
    assert missing == []


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", OURS)
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
from bapo_nemo.nemo.partial_rollout import install_partial_rollouts
from bapo_nemo.plan.config_io import load_nemo_config
for path in sys.argv[1:]:
    mc = MasterConfig(**load_nemo_config(path))
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


@pytest.mark.nemo_rl
def test_master_config_validates():
    """v0.7.0's MasterConfig (pydantic) accepts our configs and keeps loss_fn.bapo (extra="allow"); the
    presets' partial_rollouts blocks install on it (budget, response cap, pool; no response cut early).
    In a subprocess: on Python < 3.12 it patches typing.TypedDict, which must not leak into other tests."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _MASTER_CONFIG_SCRIPT, *(str(CONFIGS / n) for n in OURS)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_driver_without_nemo_rl_says_where_to_run(monkeypatch):
    """Outside the container the driver stops with the fix, not a traceback. nemo_rl is hidden for the
    test (a None entry in sys.modules makes its import fail) so it behaves the same everywhere."""
    from bapo_nemo.nemo.driver import main

    monkeypatch.setitem(sys.modules, "nemo_rl", None)
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms", None)
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.grpo", None)
    with pytest.raises(SystemExit, match=r"nvcr.io/nvidia/nemo-rl:v0.7.0"):
        main(["--config", str(CONFIGS / "bapo_7b.yaml")])
