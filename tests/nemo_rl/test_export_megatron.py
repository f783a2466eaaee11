"""Export of a real NeMo-RL Megatron checkpoint through Megatron-Bridge (the container, with a GPU)."""

from __future__ import annotations

import os

import pytest

from bapo_nemo.cli import main as cli_main


@pytest.mark.gpu
def test_real_megatron_checkpoint_export(tmp_path):
    """In the container: BAPO_TEST_MEGATRON_STEP_DIR points at a NeMo-RL step_<N> dir of a small model."""
    step = os.environ.get("BAPO_TEST_MEGATRON_STEP_DIR")
    if not step:
        pytest.skip("set BAPO_TEST_MEGATRON_STEP_DIR to a NeMo-RL checkpoint_dir/step_<N> to run this test")
    assert cli_main(["export", step, "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
