"""Test-only start-up shim: lets NeMo-RL v0.7.0's source (written for Python 3.13) import on 3.11.

Put this folder on PYTHONPATH (tests/conftest.py does, for the test process and every subprocess and
Ray worker it starts). Python imports `sitecustomize` at start-up, so the aliasing below happens before
any nemo_rl import:
- pydantic refuses `typing.TypedDict` before Python 3.12; NeMo-RL's configs are TypedDicts that pydantic
  validates, so `typing.TypedDict`/`typing.NotRequired` become typing_extensions' versions.
- NEMO_RL_SRC (a NeMo-RL source checkout) goes on sys.path when no installed nemo_rl exists.
"""

import importlib.util
import os
import sys
import typing

if sys.version_info < (3, 12):
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict
    typing.NotRequired = typing_extensions.NotRequired
    typing.Required = typing_extensions.Required

_src = os.environ.get("NEMO_RL_SRC")
_usable = _src and os.path.isdir(os.path.join(_src, "nemo_rl")) and _src not in sys.path
if _usable and importlib.util.find_spec("nemo_rl") is None:  # an installed nemo_rl (the container) wins
    sys.path.append(_src)
