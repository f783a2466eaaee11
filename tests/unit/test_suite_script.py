"""tests/suite.sh, the README's test command's runner, driven with stand-in programs at its boundary: `pytest`
(the one on PATH, and the one in each tree's environment), Python 3.13 (`PYTHON313`) and the environment
builder tests/support/nemo_rl_venv.sh, each recording how it was called. Real pytest runs of every part are
what CI itself does; here, what the script decides: which part runs where, against which NeMo-RL tree, in
which environment, what it prints, and the exit status."""

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
echo "python tiers ran"
[ -n "${FAIL_WHEN:-}" ] && [ "${NEMO_RL_SRC:-}" = "$FAIL_WHEN" ] && exit 1
exit 0
"""
# Python 3.13: answers the version check.
FAKE_PYTHON313 = """#!/bin/sh
if [ "$1" = -c ]; then exit 0; fi
exit 2
"""
# tests/support/nemo_rl_venv.sh TREE VENV PYTHON: records the call; VENV/bin/{pytest,python} record in turn.
FAKE_VENV_BUILDER = """#!/bin/sh
echo "venv $1 $2 $(basename "$3")" >> "$CALLS"
[ -n "${BUILD_FAILS_FOR:-}" ] && [ "$1" = "$BUILD_FAILS_FOR" ] && exit 1
mkdir -p "$2/bin"
printf '#!/bin/sh\\necho "venv-pytest $0 NEMO_RL_SRC=$NEMO_RL_SRC PYTHONPYCACHEPREFIX=$PYTHONPYCACHEPREFIX DONTWRITE=${PYTHONDONTWRITEBYTECODE:-unset} $*" >> "$CALLS"\\necho "tier ran for $NEMO_RL_SRC"\\nsleep "${TIER_SLEEPS:-0}"\\n[ -n "$FAIL_WHEN" ] && [ "$NEMO_RL_SRC" = "$FAIL_WHEN" ] && exit 1\\nexit 0\\n' > "$2/bin/pytest"
printf '#!/bin/sh\\necho "Python 3.13.0"\\n' > "$2/bin/python"
chmod +x "$2/bin/pytest" "$2/bin/python"
echo "$2: NeMo-RL $(basename "$1") in 1 s"
"""


@pytest.fixture
def checkout(tmp_path):
    """A copy of the script in a checkout-shaped directory, fakes on PATH, the calls log."""
    root = tmp_path / "checkout"
    (root / "tests" / "support").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "suite.sh", root / "tests" / "suite.sh")
    (root / "tests" / "support" / "nemo_rl_venv.sh").write_text(FAKE_VENV_BUILDER)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("pytest", FAKE_PYTEST), ("python3.13-fake", FAKE_PYTHON313)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    calls = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "HOME": str(tmp_path), "PYENV_ROOT": "/none",
           "NEMO_RL_SRCS": "/trees/v070:/trees/main", "PYTHON313": str(bin_dir / "python3.13-fake")}
    return root, bin_dir, calls, env


def run(root: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "tests" / "suite.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_every_tree_gets_the_nemo_rl_tier_in_its_own_environment_beside_the_python_tiers(checkout):
    root, _, calls, env = checkout
    done = run(root, env, "-x")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [re.sub(r" PYTHONPYCACHEPREFIX=\S* DONTWRITE=\S*", "", line) for line in calls.read_text().splitlines()]
    # All parts start at once: the package's tiers, and each tree's build then its tier; the second tree's
    # environment is built after the first's (its packages then come from uv's cache).
    assert "pytest NEMO_RL_SRC= tests/unit tests/cli tests/slurm -x" in lines  # no tree in sight
    v070 = [line for line in lines if "v070" in line]
    main = [line for line in lines if "main" in line]
    assert v070 == ["venv /trees/v070 .venv-nemo-rl/v070 python3.13-fake",
                    "venv-pytest .venv-nemo-rl/v070/bin/pytest NEMO_RL_SRC=/trees/v070 tests/nemo_rl -n 1 -x"]
    assert main == ["venv /trees/main .venv-nemo-rl/main python3.13-fake",
                    "venv-pytest .venv-nemo-rl/main/bin/pytest NEMO_RL_SRC=/trees/main tests/nemo_rl -n 1 -x"]
    assert lines.index(v070[0]) < lines.index(main[0])
    # each part's log printed whole, in a fixed order, then one line per part
    out = done.stdout
    assert out.index("python tiers ran") < out.index("tier ran for /trees/v070") < out.index("tier ran for /trees/main")
    assert ".venv-nemo-rl/main: NeMo-RL main in 1 s" in out
    assert re.search(r"^ok: nemo_rl-main \(\d+ s\)$", out, re.MULTILINE), out
    assert re.search(r"^ok: unit\+cli\+slurm \(\d+ s\)$", out, re.MULTILINE), out
    assert "FAILED" not in out


def test_a_failing_tier_fails_the_command_and_is_named(checkout):
    root, _, _, env = checkout
    done = run(root, {**env, "FAIL_WHEN": "/trees/main"})
    assert done.returncode == 1
    assert re.search(r"^FAILED \(exit 1\): nemo_rl-main \(\d+ s\)$", done.stdout, re.MULTILINE), done.stdout
    assert "ok: nemo_rl-v070" in done.stdout and "ok: unit+cli+slurm" in done.stdout


def test_an_environment_that_does_not_build_fails_its_tier_and_the_next_tree_still_runs(checkout):
    root, _, calls, env = checkout
    done = run(root, {**env, "BUILD_FAILS_FOR": "/trees/v070"})
    assert done.returncode == 1
    assert "could not build .venv-nemo-rl/v070 for /trees/v070" in done.stdout
    assert "FAILED (exit 1): nemo_rl-v070" in done.stdout and "ok: nemo_rl-main" in done.stdout
    assert not any("NEMO_RL_SRC=/trees/v070" in line for line in calls.read_text().splitlines())


def test_without_python_313_one_line_says_how_and_only_this_pythons_tiers_run(checkout):
    root, _, calls, env = checkout
    env = {k: v for k, v in env.items() if k != "PYTHON313"}
    done = run(root, env)
    assert done.returncode == 0, done.stdout + done.stderr
    (said,) = [line for line in done.stdout.splitlines() if "Python 3.13" in line]
    assert said.startswith("Python 3.13 (NeMo-RL's own) not found: the NeMo-RL tier (tests/nemo_rl) is skipped")
    assert "pyenv install 3.13" in said and "PYTHON313" in said
    assert calls.read_text().splitlines() == ["pytest NEMO_RL_SRC= tests/unit tests/cli tests/slurm"]


def test_without_a_tree_it_is_plain_pytest(checkout):
    root, _, calls, env = checkout
    env = {k: v for k, v in env.items() if k != "NEMO_RL_SRCS"}
    assert run(root, env, "-k", "x").returncode == 0
    assert calls.read_text().splitlines() == ["pytest NEMO_RL_SRC= tests/unit tests/cli tests/slurm -k x"]


def test_the_tier_caches_bytecode_in_its_environment_even_where_writing_it_is_turned_off(checkout):
    root, _, calls, env = checkout
    done = run(root, {**env, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    tier_calls = [line for line in calls.read_text().splitlines() if line.startswith("venv-pytest")]
    assert len(tier_calls) == 2
    for line, tree in zip(sorted(tier_calls), ("main", "v070")):
        assert f"PYTHONPYCACHEPREFIX={root}/.venv-nemo-rl/{tree}/pycache " in line
        assert "DONTWRITE=unset" in line


def test_a_part_still_running_prints_a_progress_line_with_its_newest_output(checkout):
    root, _, _, env = checkout
    done = run(root, {**env, "PROGRESS_S": "1", "TIER_SLEEPS": "8"})
    assert done.returncode == 0, done.stdout + done.stderr
    progress = re.findall(r"^== \d+ s, (nemo_rl-\w+): (.*)$", done.stdout, flags=re.MULTILINE)
    assert {name for name, _ in progress} == {"nemo_rl-v070", "nemo_rl-main"}
    for tree in ("v070", "main"):
        assert (f"nemo_rl-{tree}", f"tier ran for /trees/{tree}") in progress


def test_a_part_past_its_limit_is_stopped_and_named_and_the_others_still_report(checkout):
    root, _, _, env = checkout
    done = run(root, {**env, "PART_LIMIT_S": "3", "TIER_SLEEPS": "100"})
    assert done.returncode == 1
    for tree in ("v070", "main"):
        assert f"FAILED: nemo_rl-{tree} stopped at its limit of 3 s (PART_LIMIT_S)" in done.stdout
    assert re.search(r"^ok: unit\+cli\+slurm \(\d+ s\)$", done.stdout, flags=re.MULTILINE), done.stdout
