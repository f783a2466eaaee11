"""Test-only start-up shim: NeMo-RL's source tree (NEMO_RL_SRC) importable in every process of a test run.

Put this folder on PYTHONPATH (tests/conftest.py does, for the test process and every subprocess and
Ray worker it starts). Python imports `sitecustomize` at start-up, so this happens before any nemo_rl import:
- NEMO_RL_SRC (a NeMo-RL source checkout) goes on sys.path when no installed nemo_rl exists;
- only on Python < 3.12 (the fallback when a machine has no Python 3.13, see tests/suite.sh): pydantic
  refuses `typing.TypedDict` there, and NeMo-RL's configs are TypedDicts that pydantic validates, so
  `typing.TypedDict`/`typing.NotRequired` become typing_extensions' versions. On 3.12+ nothing is aliased.
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
