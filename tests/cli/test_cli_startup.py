"""`bapo-nemo check` and the config validation of `bapo-nemo train` run without importing torch (their
answer in a fraction of a second instead of torch's start-up): the algorithm/ and rollout/ packages load a
submodule only when one of its names is first used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def test_check_and_the_run_config_import_no_torch(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: [32\n")
    program = f"""
import sys
from bapo_nemo.cli import main
assert main(["check", {str(REPO / "configs" / "bapo_7b.yaml")!r}, "--nodes", "1", "--gpus-per-node", "8"]) == 0
assert main(["train", {str(bad)!r}, "--output-dir", {str(tmp_path / "out")!r}]) == 2
from bapo_nemo.algorithm import BAPOConfig
from bapo_nemo.rollout import PartialRolloutConfig
print(sorted(m for m in ("torch", "transformers", "mlflow") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
                          timeout=HANG_GUARD_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
    assert "not valid YAML" in done.stderr


def test_the_packages_still_export_every_name_they_list():
    from bapo_nemo import algorithm, rollout

    for package in (algorithm, rollout):
        assert package.__all__ == dir(package)
        for name in package.__all__:
            assert getattr(package, name) is not None, name
