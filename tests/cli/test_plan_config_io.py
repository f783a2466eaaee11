"""The `${mul:...}`/`${div:...}`/`${max:...}` resolvers register without a warning on every OmegaConf a user
can get: 2.3 (the nemo-cpu extra and NeMo-RL v0.7.0 pin 2.3.0) and 2.4, which deprecates
`register_new_resolver` (a fresh `pip install -e .` resolves `omegaconf>=2.3` to 2.4)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bapo_nemo.plan.rules.config_io import load_nemo_config
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
OMEGACONF_24 = "omegaconf==2.4.0"  # pure Python, needs only PyYAML: importable straight from its wheel


def test_resolvers_register_and_resolve_without_a_warning(tmp_path):
    for name in ("mul", "div", "max"):
        OmegaConf.clear_resolver(name)  # make load_nemo_config register them again, under the filter below
    config = tmp_path / "c.yaml"
    config.write_text("a: 6\nb: 4\nprod: ${mul:${a},${b}}\nratio: ${div:${a},${b}}\nbig: ${max:${a},${b}}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = load_nemo_config(config)
    assert (resolved["prod"], resolved["ratio"], resolved["big"]) == (24, 1.5, 6)


@pytest.fixture(scope="module")
def omegaconf_24_wheel(tmp_path_factory) -> Path:
    into = tmp_path_factory.mktemp("omegaconf-2.4")  # pip's own cache makes a second download local
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(into),
         OMEGACONF_24], capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )
    wheels = sorted(into.glob("omegaconf-2.4.0-*.whl"))
    if not wheels:
        pytest.skip(f"cannot download {OMEGACONF_24} (no package index reachable?): {got.stderr[-500:]}")
    return wheels[0]


def test_bapo_nemo_check_prints_no_warning_on_omegaconf_2_4(omegaconf_24_wheel):
    """The user's symptom end to end: `bapo-nemo check` printed a deprecation warning on every run."""
    program = ("import sys, omegaconf; assert omegaconf.__version__ == '2.4.0', omegaconf.__file__; "
               "from bapo_nemo.cli import main; sys.exit(main())")
    pythonpath = os.pathsep.join([str(omegaconf_24_wheel), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", program, "check", str(REPO / "configs" / "bapo_7b.yaml"), "--nodes", "1",
         "--gpus-per-node", "8"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath}, capture_output=True, text=True, timeout=HANG_GUARD_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Warning" not in result.stderr, result.stderr
