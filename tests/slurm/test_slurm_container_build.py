"""The container build helpers, run for real where they can be.

- `containers/install_into_venvs.sh` (the Dockerfile's build step) runs against this test's own venv as
  NeMo-RL's driver venv, and against "actor venvs" that are this Python behind a wrapper script (one
  with a dependency shadowed to look missing). NeMo-RL is absent here, so `bapo_nemo.nemo.loss` does not
  import: that is the warning / strict-mode failure path.
- `containers/make_squashfs.sh` needs enroot and docker, which cannot run here: they are replaced by
  small fakes at that boundary (they record their arguments and write a file), so what is tested is the
  script's own logic: which URI it imports, overwrite protection, restoring the previous image.
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
INSTALL = REPO / "containers" / "install_into_venvs.sh"
MAKE_SQUASHFS = REPO / "containers" / "make_squashfs.sh"


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


# ---------------------------------------------------------------------------------------------------------
# install_into_venvs.sh
# ---------------------------------------------------------------------------------------------------------


def _actor_venv(root: Path, name: str, shadow: Path | None = None) -> None:
    prefix = f'PYTHONPATH="{shadow}${{PYTHONPATH:+:$PYTHONPATH}}" ' if shadow else ""
    _executable(root / name / "bin" / "python", f'#!/bin/sh\n{prefix}exec "{sys.executable}" "$@"\n')


def run_install(tmp_path: Path, strict: bool, with_actor: bool = True) -> subprocess.CompletedProcess:
    actors = tmp_path / "ray_venvs"
    actors.mkdir()
    # An actor venv where `rich` cannot be imported: the script must install it with --no-deps.
    shadow = tmp_path / "shadow"
    (shadow / "rich").mkdir(parents=True)
    (shadow / "rich" / "__init__.py").write_text("raise ImportError('rich hidden by the test')\n")
    if with_actor:
        _actor_venv(
            actors, "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker", shadow
        )
    env = {
        **os.environ,
        "BAPO_NEMO_HOME": str(REPO),
        "DRIVER_VENV": sys.prefix,
        "NEMO_RL_VENV_DIR": str(actors),
        "BAPO_CLI_PATH": str(tmp_path / "bin" / "bapo-nemo"),
        "BAPO_STRICT_IMPORT_CHECK": "1" if strict else "0",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(INSTALL)], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False
    )


@pytest.fixture(scope="module")
def nemo_rl_absent():
    import importlib.util

    if importlib.util.find_spec("nemo_rl") is not None:
        pytest.skip("NeMo-RL is installed here: the missing-loss-import path cannot be exercised")


def test_install_checks_every_venv_and_keeps_torch(tmp_path, nemo_rl_absent):
    import torch

    result = run_install(tmp_path, strict=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "checking 2 venv(s)" in out  # the driver venv + 1 actor venv
    assert out.count(f"ok (torch {torch.__version__})") == 2
    assert "lacks rich>=13: installing with --no-deps" in out
    assert out.count("lacks") == 1  # nothing else was missing anywhere
    # no nemo_rl here: reported with the reason, not fatal
    assert out.count("cannot import bapo_nemo.nemo.loss") == 2
    assert "No module named 'nemo_rl'" in out
    cli = subprocess.run(
        [str(tmp_path / "bin" / "bapo-nemo"), "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert cli.returncode == 0 and "train" in cli.stdout


def test_install_strict_mode_fails_when_the_loss_cannot_import(tmp_path, nemo_rl_absent):
    result = run_install(tmp_path, strict=True, with_actor=False)  # the driver venv alone: faster
    assert result.returncode == 1
    assert "1 venv(s) cannot import bapo_nemo.nemo.loss (BAPO_STRICT_IMPORT_CHECK=1)" in result.stderr


# ---------------------------------------------------------------------------------------------------------
# make_squashfs.sh with fake enroot/docker
# ---------------------------------------------------------------------------------------------------------

FAKE_ENROOT = """#!/bin/sh
echo "enroot $*" >> "$FAKE_LOG"
[ "$FAKE_ENROOT_FAIL" = 1 ] && exit 1
[ "$1" = import ] && [ "$2" = -o ] && printf 'squashfs of %s' "$4" > "$3"
exit 0
"""
FAKE_DOCKER = """#!/bin/sh
echo "docker $*" >> "$FAKE_LOG"
if [ "$1" = image ] && [ "$2" = inspect ]; then [ "$3" = bapo-nemo:present ]; exit $?; fi
exit 0
"""


@pytest.fixture
def fake_tools(tmp_path):
    bin_dir = tmp_path / "fakebin"
    _executable(bin_dir / "enroot", FAKE_ENROOT)
    _executable(bin_dir / "docker", FAKE_DOCKER)
    log = tmp_path / "calls.log"
    log.touch()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(log),
        "FAKE_ENROOT_FAIL": "0",
    }
    return env, log, bin_dir


def squashfs(env, *args):
    return subprocess.run(
        ["bash", str(MAKE_SQUASHFS), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_imports_a_local_image_from_the_docker_daemon(fake_tools, tmp_path):
    env, log, _ = fake_tools
    out = tmp_path / "img.sqsh"
    result = squashfs(env, "--tag", "bapo-nemo:present", "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert f"enroot import -o {out} dockerd://bapo-nemo:present" in log.read_text()
    assert out.read_text() == "squashfs of dockerd://bapo-nemo:present"


def test_build_runs_docker_build_on_the_repository_first(fake_tools, tmp_path):
    env, log, _ = fake_tools
    result = squashfs(env, "--build", "--tag", "bapo-nemo:present", "--output", str(tmp_path / "img.sqsh"))
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    build = calls.index(
        f"docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/nemo-rl:v0.7.0 -t bapo-nemo:present -f {REPO}/Dockerfile {REPO}"
    )
    assert build < next(i for i, c in enumerate(calls) if c.startswith("enroot import"))


def test_build_takes_the_nemo_rl_image_to_build_on(fake_tools, tmp_path):
    """The Dockerfile's BASE_IMAGE is the NeMo-RL image; the build passes the one asked for."""
    env, log, _ = fake_tools
    image = "nvcr.io/nvidia/nemo-rl:v0.8.0"
    result = squashfs(env, "--build", "--nemo-rl-image", image, "--tag", "bapo-nemo:present",
                      "--output", str(tmp_path / "img.sqsh"))
    assert result.returncode == 0, result.stderr
    assert f"docker build --build-arg BASE_IMAGE={image} -t bapo-nemo:present" in log.read_text()
    assert "ARG BASE_IMAGE=nvcr.io/nvidia/nemo-rl:v0.7.0\nFROM ${BASE_IMAGE}" in (REPO / "Dockerfile").read_text()


def test_imports_from_a_registry_without_docker(fake_tools, tmp_path):
    env, log, _ = fake_tools
    out = tmp_path / "img.sqsh"
    result = squashfs(env, "--registry", "nvcr.io#myorg/bapo-nemo:v1", "--output", str(out))
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls == [f"enroot import -o {out} docker://nvcr.io#myorg/bapo-nemo:v1"]  # docker never called


def test_an_existing_image_is_kept_unless_forced_and_restored_if_the_import_fails(fake_tools, tmp_path):
    env, log, _ = fake_tools
    out = tmp_path / "img.sqsh"
    out.write_text("the image that works")
    refused = squashfs(env, "--tag", "bapo-nemo:present", "--output", str(out))
    assert refused.returncode == 1 and "exists; pass --force" in refused.stderr
    assert "enroot import" not in log.read_text()

    failed = squashfs(
        {**env, "FAKE_ENROOT_FAIL": "1"}, "--force", "--tag", "bapo-nemo:present", "--output", str(out)
    )
    assert failed.returncode != 0
    assert out.read_text() == "the image that works" and not (tmp_path / "img.sqsh.previous").exists()

    replaced = squashfs(env, "--force", "--tag", "bapo-nemo:present", "--output", str(out))
    assert replaced.returncode == 0, replaced.stderr
    assert out.read_text() == "squashfs of dockerd://bapo-nemo:present"
    assert not (tmp_path / "img.sqsh.previous").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tag", "bapo-nemo:absent"], "image bapo-nemo:absent is not in the local docker daemon"),
        (["--build", "--registry", "x#y:z"], "--build and --registry exclude each other"),
        (["--tag", "bapo-nemo:present", "--nemo-rl-image", "x:y"], "--nemo-rl-image only applies with --build"),
        (["--output", "/nonexistent-dir/img.sqsh"], "output directory /nonexistent-dir does not exist"),
        (["--colour"], "unknown option: --colour"),
    ],
)
def test_bad_arguments_get_a_clear_error(fake_tools, tmp_path, args, message):
    env, _, _ = fake_tools
    if "--output" not in args:
        args = [*args, "--output", str(tmp_path / "img.sqsh")]
    result = squashfs(env, *args)
    assert result.returncode == 1 and message in result.stderr, result.stderr


def test_missing_enroot_is_named(fake_tools, tmp_path):
    env, _, bin_dir = fake_tools
    (bin_dir / "enroot").unlink()
    if shutil.which("enroot", path=env["PATH"]):
        pytest.skip("a real enroot is on PATH")
    result = squashfs(env, "--tag", "bapo-nemo:present", "--output", str(tmp_path / "img.sqsh"))
    assert result.returncode == 1 and "enroot not found" in result.stderr
