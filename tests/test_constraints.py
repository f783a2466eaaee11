"""constraints/cpu-py311.txt, the lock the README's commands and .ci/run install with, pins every package
that pyproject.toml names (the base dependencies and every extra) at a version pyproject.toml allows, on
torch's CPU build. A dependency added or changed without `bash constraints/refresh.sh` fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "constraints" / "cpu-py311.txt"
LOCK_OPTION = "-c constraints/cpu-py311.txt"
# What the lock is resolved for (constraints/refresh.sh: --python-version 3.11, x86_64-manylinux_2_28).
TARGET = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
# The CUDA runtime that PyPI's torch wheels for Linux pull in; the CPU build needs none of it.
CUDA_RUNTIME = re.compile(r"nvidia-(cu|nccl|nvjitlink|nvshmem|nvtx|cufile)|triton$|cuda-")


def locked() -> dict[str, Version]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version.strip())
    return pins


def declared() -> dict[str, list[Requirement]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return {group: [Requirement(r) for r in reqs] for group, reqs in groups.items()}


def test_every_declared_package_is_pinned_at_a_version_pyproject_allows():
    pins = locked()
    problems = []
    for group, requirements in declared().items():
        for req in requirements:
            if req.marker is not None and not req.marker.evaluate({**TARGET, "extra": group}):
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
