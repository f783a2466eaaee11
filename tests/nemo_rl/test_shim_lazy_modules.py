"""The CPU Megatron shim's start-up savings (tests/support/nemo_rl_shim/megatron_cpu.py, parts 4 and 5).

Part 4: wandb, mlflow and swanlab load on first use, not when NeMo-RL's logger module imports them; reading
what names a module (`inspect.getmodule`, which torch's operator registration calls on every loaded module,
and a second `import`) is no use, and a real use gives the real module. Part 5: a tensor pickled after the
shim is in unpickles, equal, in a process that never imports megatron-core, and still through
megatron-core's loader where it is imported. In subprocesses (the shim patches its process), on NeMo-RL's
Python: 3.13's lazy loading is not 3.11's."""

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


SENDER = """
import pickle, sys, torch
from tests.support.nemo_rl_shim import megatron_cpu
megatron_cpu.install()
assert torch.storage._load_from_bytes.__name__ == "safe_load_from_bytes"  # megatron-core's, in this process
sys.stdout.buffer.write(pickle.dumps({"w": torch.arange(6.0).reshape(2, 3), "ids": torch.tensor([3, 1, 4])}))
"""

RECEIVER = """
import json, pickle, sys, torch
got = pickle.loads(sys.stdin.buffer.read())
print(json.dumps([got["w"].tolist(), got["ids"].tolist(), sorted(m for m in sys.modules if m.startswith("megatron"))]))
"""


def test_a_tensor_pickled_beside_megatron_core_unpickles_without_importing_it():
    pytest.importorskip("megatron.core", reason="megatron-core (the nemo-cpu extra) is what the shim patches")
    sent = subprocess.run([sys.executable, "-W", "ignore", "-c", SENDER], cwd=REPO, capture_output=True,
                          timeout=300, check=False)
    assert sent.returncode == 0, sent.stderr[-3000:].decode(errors="replace")
    assert b"megatron" not in sent.stdout
    received = subprocess.run([sys.executable, "-c", RECEIVER], cwd=REPO, input=sent.stdout,
                              capture_output=True, timeout=300, check=False)
    assert received.returncode == 0, received.stderr[-3000:].decode(errors="replace")
    weights, ids, megatron_modules = json.loads(received.stdout.decode().splitlines()[-1])
    assert (weights, ids, megatron_modules) == ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [3, 1, 4], [])
    # Where megatron-core is imported, the same bytes load through its weights-only loader.
    with_megatron = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", "import megatron.core\n" + RECEIVER], cwd=REPO, input=sent.stdout,
        capture_output=True, timeout=300, check=False)
    assert with_megatron.returncode == 0, with_megatron.stderr[-3000:].decode(errors="replace")
    assert json.loads(with_megatron.stdout.decode().splitlines()[-1])[:2] == [weights, ids]
