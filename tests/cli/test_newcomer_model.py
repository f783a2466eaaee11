"""What a newcomer meets first with `policy.model_name` on a machine without the Hugging Face hub: a hub id
fails at once with the ways to run offline in its first line. The hub is made unreachable the way a
machine without network sees it: HF_ENDPOINT points at a closed local port (nothing listens on port 9),
and HF_HOME at an empty cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_run import bapo_nemo, with_, write_config

CLOSED_ENDPOINT = "http://127.0.0.1:9"


def _hub_id_run(tmp_path: Path, extra_env: dict):
    cfg = write_config(tmp_path, with_(policy={"model_name": "someone/not-a-cached-model"}))
    env = {"HF_ENDPOINT": CLOSED_ENDPOINT, "HF_HOME": str(tmp_path / "hf"), **extra_env}
    return bapo_nemo("train", str(cfg), "--output-dir", str(tmp_path / "out"), cwd=tmp_path, env=env)


@pytest.mark.parametrize("extra_env", [{}, {"HF_HUB_OFFLINE": "1"}], ids=["no-network", "hf-hub-offline"])
def test_hub_id_without_the_hub_says_how_to_run_offline_in_its_first_line(tmp_path, extra_env):
    done = _hub_id_run(tmp_path, extra_env)
    assert done.returncode == 2, done.stderr[-2000:]
    first = next(line for line in done.stderr.splitlines() if line.startswith("error:"))
    assert "policy.model_name='someone/not-a-cached-model'" in first
    for way in ("HF_HUB_OFFLINE=1", "policy.model_name=smollm2-135m-instruct", "save_pretrained"):
        assert way in first, first
    assert "Traceback" not in done.stderr

