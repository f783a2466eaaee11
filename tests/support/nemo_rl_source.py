"""Run a snippet against NeMo-RL's own source (the tree in NEMO_RL_SRC) in a child process, so that nemo_rl
on sys.path (and, on Python < 3.12, `typing.TypedDict`/`NotRequired` aliased to typing_extensions', which
pydantic needs for NeMo-RL's 3.12+ code) never leaks into the other tests of the session. The tests using
it are marked nemo_rl: they run in the NeMo-RL tier (tests/suite.sh), once per tree. Skips when a
dependency of the imported module is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_IMPORT_FAILED = 3

_PRELUDE = """
import json, sys, typing
if sys.version_info < (3, 12):
    import typing_extensions
    typing.TypedDict = typing_extensions.TypedDict
    typing.NotRequired = typing_extensions.NotRequired
sys.path.append({source!r})
"""


def run_with_nemo_rl(imports: str, body: str, cwd: Path | None = None, env: dict | None = None):
    """Run `imports` (skip if they fail) then `body`, which prints one JSON value: returned parsed."""
    source = Path(os.environ.get("NEMO_RL_SRC", ""))
    if not (source / "nemo_rl").is_dir():
        pytest.skip(f"NeMo-RL source not found at {str(source)!r} (set NEMO_RL_SRC)")
    code = (
        _PRELUDE.format(source=str(source))
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
        pytest.skip(f"cannot import from {source}: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
