"""A copied preset read by the NeMo-RL driver (NeMo-RL's own loader) as `bapo-nemo check` reads it
(tests/cli/test_plan_copied_preset.py): its bare `defaults:` name resolved against the shipped configs/."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from bapo_nemo.plan.rules.config_io import ConfigLoadError, load_nemo_config

REPO = Path(__file__).resolve().parents[2]


def test_the_driver_reads_a_copied_preset_as_check_does(tmp_path, capsys):
    from bapo_nemo.nemo.driver import load_config

    shutil.copy(REPO / "configs" / "bapo_32b_partial.yaml", tmp_path / "mine.yaml")
    overrides = ["grpo.max_num_steps=3"]
    driver = load_config(argparse.Namespace(config=str(tmp_path / "mine.yaml")), overrides)
    assert "defaults bapo_32b.yaml not beside it: read from the shipped presets" in capsys.readouterr().out
    assert driver == load_nemo_config(tmp_path / "mine.yaml", overrides)
    (tmp_path / "mid.yaml").write_text("defaults: bapo_7b.yaml\n")
    (tmp_path / "top.yaml").write_text("defaults: mid.yaml\n")
    with pytest.raises(ConfigLoadError, match="it is a shipped preset: write `defaults: "):
        load_config(argparse.Namespace(config=str(tmp_path / "top.yaml")), [])
