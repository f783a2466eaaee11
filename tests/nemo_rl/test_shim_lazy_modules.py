"""The CPU Megatron shim's start-up saving (tests/support/nemo_rl_shim/megatron_cpu.py, part 4): wandb, mlflow
and swanlab load on first use, not when NeMo-RL's logger module imports them; reading what names a module
(`inspect.getmodule`, which torch's operator registration calls on every loaded module, and a second
`import`) is no use, and a real use gives the real module. In a subprocess (the shim patches its process),
on NeMo-RL's Python: 3.13's lazy loading is not 3.11's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROGRAM = """
import inspect, json, sys
from tests.support.nemo_rl_shim import megatron_cpu
megatron_cpu.install()
import wandb
lazy = type(sys.modules["wandb"]).__name__
inspect.getmodule(json.dumps)  # walks sys.modules reading __class__ and __file__
import wandb as again
still_lazy = type(sys.modules["wandb"]).__name__
version = wandb.__version__
print(json.dumps([lazy, still_lazy, version, type(sys.modules["wandb"]).__name__]))
"""


def test_a_module_loads_on_its_first_use_not_when_it_is_named():
    pytest.importorskip("megatron.core", reason="megatron-core (the nemo-cpu extra) is what the shim patches")
    from importlib.metadata import version

    done = subprocess.run([sys.executable, "-W", "ignore", "-c", PROGRAM], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lazy, still_lazy, loaded_version, loaded = json.loads(done.stdout.splitlines()[-1])
    assert (lazy, still_lazy) == ("_ModuleLoadedOnFirstUse", "_ModuleLoadedOnFirstUse")
    assert (loaded_version, loaded) == (version("wandb"), "module")
