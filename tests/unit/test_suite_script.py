"""tests/suite.sh, the README's test command's runner, driven with stand-in programs at its boundary: `pytest`
(the one on PATH, and the one in .venv-nemo-rl) and Python 3.13 (`PYTHON313`), each recording how it was
called. Real pytest runs of both parts are what CI itself does; here, what the script decides: which part
runs where, against which NeMo-RL tree, with which lock, and the exit status."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# pytest on PATH: records its arguments and NEMO_RL_SRC; fails when FAIL_WHEN matches its NEMO_RL_SRC.
FAKE_PYTEST = """#!/bin/sh
echo "pytest NEMO_RL_SRC=${NEMO_RL_SRC:-} $*" >> "$CALLS"
[ -n "${FAIL_WHEN:-}" ] && [ "${NEMO_RL_SRC:-}" = "$FAIL_WHEN" ] && exit 1
exit 0
"""
# Python 3.13: answers the version check, and `-m venv DIR` makes DIR/bin/{pip,pytest,python} that record.
FAKE_PYTHON313 = """#!/bin/sh
if [ "$1" = -c ]; then exit 0; fi
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin"
  printf '#!/bin/sh\\necho "venv-pip $*" >> "$CALLS"\\n' > "$3/bin/pip"
  printf '#!/bin/sh\\necho "venv-pytest NEMO_RL_SRC=$NEMO_RL_SRC $*" >> "$CALLS"\\n[ -n "$FAIL_WHEN" ] && [ "$NEMO_RL_SRC" = "$FAIL_WHEN" ] && exit 1\\nexit 0\\n' > "$3/bin/pytest"
  printf '#!/bin/sh\\necho "Python 3.13.0"\\n' > "$3/bin/python"
  chmod +x "$3/bin/pip" "$3/bin/pytest" "$3/bin/python"
  exit 0
fi
exit 2
"""


@pytest.fixture
def checkout(tmp_path):
    """A copy of the script in a checkout-shaped directory, fakes on PATH, the calls log."""
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "suite.sh", root / "tests" / "suite.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("pytest", FAKE_PYTEST), ("python3.13-fake", FAKE_PYTHON313)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    calls = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "HOME": str(tmp_path), "PYENV_ROOT": "/none"}
    return root, bin_dir, calls, env


def run(root: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "tests" / "suite.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_every_tree_gets_the_nemo_rl_tier_on_python_313(checkout):
    root, bin_dir, calls, env = checkout
    done = run(root, {**env, "NEMO_RL_SRCS": "/trees/v070:/trees/main", "PYTHON313": str(bin_dir / "python3.13-fake")}, "-x")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = calls.read_text().splitlines()
    # The NeMo-RL environment is built in the background while the rest of the suite runs: those two lines
    # come in either order, and both before the tiers, which wait for the build.
    assert sorted(lines[:2]) == [
        "pytest NEMO_RL_SRC= tests/unit tests/cli tests/slurm -x",  # the rest of the suite, no tree in sight
        "venv-pip install -q -c constraints/nemo-rl-py313.txt torch==2.13.0 -e .[test,nemo-cpu]",
    ]
    assert lines[2:] == ["venv-pytest NEMO_RL_SRC=/trees/v070 tests/nemo_rl -x",
                         "venv-pytest NEMO_RL_SRC=/trees/main tests/nemo_rl -x"]
    assert re.search(r"^ok: tests/nemo_rl, /trees/main \(\d+ s\)$", done.stdout, re.MULTILINE), done.stdout
    assert "FAILED" not in done.stdout


def test_a_failing_tier_fails_the_command_and_is_named(checkout):
    root, bin_dir, _, env = checkout
    done = run(root, {**env, "NEMO_RL_SRCS": "/trees/v070:/trees/main", "FAIL_WHEN": "/trees/main",
                      "PYTHON313": str(bin_dir / "python3.13-fake")})
    assert done.returncode == 1
    assert "FAILED (exit 1): tests/nemo_rl, /trees/main" in done.stdout
    assert "ok: tests/nemo_rl, /trees/v070" in done.stdout


def test_without_python_313_one_line_says_how_and_only_this_pythons_tiers_run(checkout):
    root, _, calls, env = checkout
    done = run(root, {**env, "NEMO_RL_SRCS": "/trees/v070:/trees/main"})
    assert done.returncode == 0, done.stdout + done.stderr
    (said,) = [line for line in done.stdout.splitlines() if "Python 3.13" in line]
    assert said.startswith("Python 3.13 (NeMo-RL's own) not found: the NeMo-RL tier (tests/nemo_rl) is skipped")
    assert "pyenv install 3.13" in said and "PYTHON313" in said
    assert calls.read_text().splitlines() == ["pytest NEMO_RL_SRC= tests/unit tests/cli tests/slurm"]


def test_without_a_tree_it_is_plain_pytest(checkout):
    root, _, calls, env = checkout
    assert run(root, env, "-k", "x").returncode == 0
    assert calls.read_text().splitlines() == ["pytest NEMO_RL_SRC= tests/unit tests/cli tests/slurm -k x"]
