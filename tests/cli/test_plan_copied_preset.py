"""A copied preset works where it is copied to (`cp configs/bapo_32b.yaml my32b.yaml`): its bare `defaults:`
name, not beside the copy, is read from the shipped configs/ with one line saying so, by `bapo-nemo check`
and by the NeMo-RL driver alike; an entry that cannot be resolved so is an error with the line that fixes
it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bapo_nemo.plan.rules.config_io import SHIPPED_CONFIGS, ConfigLoadError, load_nemo_config
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
SHAPE = ["--nodes", "8", "--gpus-per-node", "8"]


def _check(tmp_path: Path, *argv: str):
    return cli_process.run("check", *argv, cwd=tmp_path, env=cli_process.cli_env(), timeout=HANG_GUARD_S)


def test_a_copied_preset_checks_as_the_preset_with_one_line_saying_where_its_parent_is(tmp_path):
    shutil.copy(REPO / "configs" / "bapo_32b.yaml", tmp_path / "my32b.yaml")
    copy = _check(tmp_path, "my32b.yaml", *SHAPE, "--json")
    assert copy.returncode == 0, copy.stdout[-3000:] + copy.stderr[-2000:]
    mine, shipped = json.loads(copy.stdout), json.loads(_check(tmp_path, str(REPO / "configs" / "bapo_32b.yaml"),
                                                                *SHAPE, "--json").stdout)
    notes = [f for f in mine["findings"] if f["key"] == "defaults"]
    assert notes == [{"level": "warning", "key": "defaults", "message":
                      f"my32b.yaml: defaults bapo_7b.yaml not beside it: read from the shipped presets, {SHIPPED_CONFIGS}"}]
    assert {k: v for k, v in mine.items() if k != "findings"} == {k: v for k, v in shipped.items() if k != "findings"}
    text = _check(tmp_path, "my32b.yaml", *SHAPE)
    assert text.returncode == 0 and text.stdout.strip().splitlines()[-1].startswith("OK: 0 error(s)")


def test_an_entry_beside_the_copy_wins_and_a_mix_is_an_error_with_the_fix(tmp_path):
    """An own parent beside the file is read, never swapped for a shipped one; with one entry beside and one
    not, no single directory serves both: the error gives the missing one's shipped path."""
    (tmp_path / "mine.yaml").write_text("defaults: [local.yaml, bapo_7b.yaml]\ngrpo: {max_num_steps: 3}\n")
    (tmp_path / "local.yaml").write_text("grpo: {seed: 7}\n")
    done = _check(tmp_path, "mine.yaml", "--nodes", "1", "--gpus-per-node", "8")
    assert done.returncode == 1
    assert ("mine.yaml: defaults entry 'bapo_7b.yaml' -> bapo_7b.yaml does not exist: it is a "
            f"shipped preset: write `defaults: {SHIPPED_CONFIGS / 'bapo_7b.yaml'}`") in " ".join(done.stdout.split())


def test_a_parent_of_a_parent_resolves_beside_its_own_file(tmp_path):
    """NeMo-RL resolves a parent's entries beside that parent: a chain mine -> mid (beside) -> bapo_7b (not
    beside mid) fails there, naming the fix."""
    (tmp_path / "mine.yaml").write_text("defaults: mid.yaml\n")
    (tmp_path / "mid.yaml").write_text("defaults: bapo_7b.yaml\n")
    with pytest.raises(ConfigLoadError, match=r"mid.yaml: defaults entry 'bapo_7b.yaml' .* write `defaults: "):
        load_nemo_config(tmp_path / "mine.yaml")


