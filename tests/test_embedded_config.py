"""Run-config schema of the embedded trainer: key errors name the key, overrides are checked, the loss
presets are what they claim, and resume compatibility ignores only the harmless keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bapo_nemo.algorithm import search_clip_bounds
from bapo_nemo.embedded.config import RunConfigError, config_differences, load_config, validate_config

REPO = Path(__file__).resolve().parents[1]


def test_default_config_file_loads():
    cfg = load_config(REPO / "configs" / "local_cpu.yaml")
    assert (
        cfg.loss.bapo.enabled and cfg.rollout.partial.token_budget < cfg.rollout.partial.max_response_tokens
    )


def test_unknown_yaml_key_names_the_key_and_close_matches(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_step: 3\nloss:\n  bapo:\n    rh0: 0.5\n")
    with pytest.raises(RunConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert str(path) in msg
    assert "train.max_step: unknown key" in msg and "train.max_steps" in msg
    assert "loss.bapo.rh0: unknown key" in msg and "loss.bapo.rho0" in msg


def test_unknown_override_key_is_an_error_listing_close_matches():
    with pytest.raises(
        RunConfigError, match=r"unknown config key 'optim.learning_rate'.*did you mean"
    ) as exc:
        load_config(None, ["optim.learning_rate=0.1"])
    assert "optim.lr" in str(exc.value) or "warmup.lr" in str(exc.value)
    with pytest.raises(RunConfigError, match="key.sub=value"):
        load_config(None, ["optim.lr"])


def test_override_values_are_parsed_and_validated_with_the_yaml_key():
    cfg = load_config(None, ["loss.bapo.rho0=0.5", "train.max_steps=7", "loss.bapo.dual_clip=null"])
    assert cfg.loss.bapo.rho0 == 0.5 and cfg.train.max_steps == 7 and cfg.loss.bapo.dual_clip is None
    with pytest.raises(RunConfigError, match=r"loss\.bapo\.rho0: rho0 must be"):
        load_config(None, ["loss.bapo.rho0=1.5"])
    with pytest.raises(RunConfigError, match=r"loss\.ratio_reference"):
        load_config(None, ["loss.ratio_reference=current"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["loss.bapo.enabled=false", "loss.bapo.c_low_min=0.8", "loss.bapo.c_high_min=1.2"], (0.8, 1.2)),
        (["loss.bapo.enabled=false", "loss.bapo.c_low_min=0.8", "loss.bapo.c_high_min=1.28"], (0.8, 1.28)),
    ],
)
def test_baseline_presets_are_fixed_bounds(overrides, expected):
    """Fixed clip and clip-higher are BAPO disabled with other starting bounds. A batch whose positive
    share is far below rho0 (one positive token against 9 negatives) would move BAPO's bounds; disabled,
    the bounds stay at the starts."""
    bapo = load_config(None, overrides).loss.bapo
    ratio = torch.tensor([[1.5] + [1.0] * 9])
    adv = torch.tensor([[1.0] + [-1.0] * 9])
    result = search_clip_bounds(ratio, adv, torch.ones_like(ratio), bapo)
    assert (result.c_low, result.c_high) == pytest.approx(expected)
    assert result.steps == 0
    enabled = load_config(None, ["loss.bapo.c_low_min=0.8"]).loss.bapo
    moved = search_clip_bounds(ratio, adv, torch.ones_like(ratio), enabled)
    assert moved.steps > 0  # the same batch does move the adaptive bounds


def test_lengths_must_fit_the_model():
    with pytest.raises(RunConfigError, match="max_position_embeddings"):
        load_config(None, ["model.max_position_embeddings=32", "rollout.partial.max_response_tokens=80"])


def test_config_differences_ignore_only_harmless_keys():
    a = validate_config({}).to_dict()
    b = validate_config(
        {"train": {"max_steps": 999}, "checkpoint": {"every": 3}, "tracking": {"run_name": "x"}}
    ).to_dict()
    assert config_differences(a, b) == []
    c = validate_config({"model": {"hidden_size": 64}, "loss": {"bapo": {"rho0": 0.5}}}).to_dict()
    diffs = config_differences(a, c)
    assert [d.split(":")[0] for d in diffs] == ["loss.bapo.rho0", "model.hidden_size"]
    assert "checkpoint=128, now=64" in diffs[1]


def test_resume_treats_a_key_added_since_the_checkpoint_as_its_default():
    from bapo_nemo.embedded.config import RunConfig, config_differences

    current = RunConfig().to_dict()
    saved = RunConfig().to_dict()
    del saved["warmup"]["step_error_rate"]  # written by an older version that did not know the key
    assert config_differences(saved, current) == []
    # ... but a run that sets the new key to a non-default value does differ.
    changed = RunConfig.model_validate({**current, "warmup": {**current["warmup"], "step_error_rate": 0.3}})
    diffs = config_differences(saved, changed.to_dict())
    assert len(diffs) == 1 and diffs[0].startswith("warmup.step_error_rate: checkpoint=")
