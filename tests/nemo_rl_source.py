"""Run a snippet against NeMo-RL v0.7.0's own source (NEMO_RL_SRC, default the shared checkout) on
Python 3.11, in a child process: v0.7.0 uses `typing.TypedDict`/`typing.NotRequired` features of 3.12+,
so they are aliased to typing_extensions' first, and neither that nor nemo_rl on sys.path leaks into the
other tests of the session (some skip on purpose when nemo_rl is not importable). Skips when the source
or a dependency of the imported module is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NEMO_RL_SRC = Path(os.environ.get("NEMO_RL_SRC", "/work/shared/upstream/nemo-rl-v0.7.0"))
_IMPORT_FAILED = 3

_PRELUDE = f"""
import json, sys, typing, typing_extensions
typing.TypedDict = typing_extensions.TypedDict
typing.NotRequired = typing_extensions.NotRequired
sys.path.append({str(NEMO_RL_SRC)!r})
"""


def run_with_nemo_rl(imports: str, body: str, cwd: Path | None = None, env: dict | None = None):
    """Run `imports` (skip if they fail) then `body`, which prints one JSON value: returned parsed."""
    if not (NEMO_RL_SRC / "nemo_rl").is_dir():
        pytest.skip(f"NeMo-RL v0.7.0 source not found at {NEMO_RL_SRC} (set NEMO_RL_SRC)")
    code = (
        _PRELUDE
        + "try:\n"
        + textwrap.indent(textwrap.dedent(imports), "    ")
        + f"\nexcept Exception as exc:\n    print(type(exc).__name__, exc, file=sys.stderr)\n    sys.exit({_IMPORT_FAILED})\n"
        + textwrap.dedent(body)
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode == _IMPORT_FAILED:
        pytest.skip(f"cannot import from {NEMO_RL_SRC}: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
