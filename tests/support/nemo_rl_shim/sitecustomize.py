"""Test-only start-up shim: NeMo-RL's source tree (NEMO_RL_SRC) importable in every process of a test run.

Put this folder on PYTHONPATH (tests/conftest.py does, for the test process and every subprocess and
Ray worker it starts). Python imports `sitecustomize` at start-up, so NEMO_RL_SRC (a NeMo-RL source
checkout) is on sys.path before any nemo_rl import, unless an installed nemo_rl (the container) exists.
"""

import importlib.util
import os
import sys

_src = os.environ.get("NEMO_RL_SRC")
_usable = _src and os.path.isdir(os.path.join(_src, "nemo_rl")) and _src not in sys.path
if _usable and importlib.util.find_spec("nemo_rl") is None:  # an installed nemo_rl (the container) wins
    sys.path.append(_src)

# A Ray worker of a private test head: forked from the head's warm zygote (tests/support/ray_zygote.py).
if os.environ.get("BAPO_TEST_RAY_ZYGOTE", "off") != "off":
    import ray_zygote_client

    ray_zygote_client.hand_over_if_asked()
