"""`ruff check` over the repository (the rules in pyproject.toml's [tool.ruff]), so a finding fails CI
instead of piling up. Uses the `ruff` beside this Python (the test extra)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.is_file():
        pytest.skip("ruff is not installed beside this Python: pip install -e '.[test]'")
    result = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
