"""The two locks pin every package pyproject.toml names for them at a version pyproject.toml allows:
constraints/cpu-py311.txt, which the README's commands and .ci/run install with (the base dependencies and
every extra, on torch's CPU build), and constraints/nemo-rl-py313.txt, the NeMo-RL tier's environment on
Python 3.13 that tests/suite.sh builds (the `test` and `nemo-cpu` extras). A dependency added or changed
without `bash constraints/refresh.sh` fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "constraints" / "cpu-py311.txt"
LOCK_OPTION = "-c constraints/cpu-py311.txt"
TIER_LOCK = REPO / "constraints" / "nemo-rl-py313.txt"
# What each lock is resolved for (constraints/refresh.sh: its --python-version, x86_64-manylinux_2_28).
PLATFORM = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}
TARGET = {"python_version": "3.11", "python_full_version": "3.11.0", **PLATFORM}
LOCKS = {  # lock -> (its target, the dependency groups it covers: None = all)
    LOCK: (TARGET, None),
    TIER_LOCK: ({"python_version": "3.13", "python_full_version": "3.13.0", **PLATFORM},
                ("dependencies", "test", "nemo-cpu")),
}
# The CUDA runtime that PyPI's torch wheels for Linux pull in; the CPU build needs none of it.
CUDA_RUNTIME = re.compile(r"nvidia-(cu|nccl|nvjitlink|nvshmem|nvtx|cufile)|triton$|cuda-")


def locked(lock: Path = LOCK) -> dict[str, Version]:
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version.strip())
    return pins


def declared() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return {group: [Requirement(r) for r in reqs] for group, reqs in groups.items()}


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_declared_package_is_pinned_at_a_version_pyproject_allows(lock):
    pins = locked(lock)
    target, groups = LOCKS[lock]
    problems = []
    for group, requirements in declared().items():
        if groups is not None and group not in groups:
            continue
        for req in requirements:
            if req.marker is not None and not req.marker.evaluate({**target, "extra": group}):
                continue
            version = pins.get(canonicalize_name(req.name))
            if version is None:
                problems.append(f"{group}: {req} is not pinned")
            elif not req.specifier.contains(version, prereleases=True):
                problems.append(f"{group}: {req} but the lock pins {version}")
    assert not problems, "run `bash constraints/refresh.sh` and commit the lock:\n" + "\n".join(problems)


def test_the_lock_is_on_torchs_cpu_build_without_the_cuda_runtime():
    pins = locked()
    assert pins["torch"].local == "cpu", pins["torch"]
    assert [name for name in pins if CUDA_RUNTIME.match(name)] == []


def test_the_readme_commands_and_ci_install_the_locked_torch_with_the_lock():
    readme = (REPO / "README.md").read_text()
    installs = [line for line in readme.splitlines() if line.startswith("python -m venv")][:2]
    assert len(installs) == 2, "the README's first screen has the main job's and the tests' set-up commands"
    torch = f"torch=={locked()['torch'].public}"
    for command in installs:
        assert f"pip install {LOCK_OPTION} {torch} -e " in command, command
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert installs[1] in ci, "keep .ci/run running the README's test command verbatim"


def test_the_nemo_rl_tier_installs_its_locked_torch_and_megatron_core():
    pins = locked(TIER_LOCK)
    assert pins["megatron-core"] >= Version("0.18")  # NeMo-RL main's Megatron worker needs 0.18+
    suite = (REPO / "tests" / "suite.sh").read_text()
    assert f"install -q -c constraints/nemo-rl-py313.txt torch=={pins['torch'].public} -e " in suite
