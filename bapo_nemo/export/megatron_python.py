"""Which Python can convert a NeMo-RL Megatron checkpoint.

In `nvcr.io/nvidia/nemo-rl:v0.7.0` the default venv (`/opt/nemo_rl_venv`, bapo-nemo's) is synced without
the `mcore` extra, so it lacks Megatron-Bridge, which `community_import` imports at its top. The export
re-runs itself with the first of: this Python (if it has Megatron-Bridge), the Megatron worker's venv
(`$NEMO_RL_VENV_DIR/<MegatronPolicyWorker fqn>`), `uv run --locked --extra mcore --directory <source> python`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

MEGATRON_WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"
DEFAULT_VENV_DIR = "/opt/ray_venvs"  # NEMO_RL_VENV_DIR of the v0.7.0 image
DEFAULT_NEMO_RL_DIR = "/opt/nemo-rl"  # NeMo-RL's source (the uv project) in the image
# Set in the re-run export, so that it never re-runs itself again.
CHILD_ENV = "BAPO_EXPORT_IN_MEGATRON_PYTHON"


def has_megatron_bridge() -> bool:
    try:
        return importlib.util.find_spec("megatron.bridge") is not None
    except (ImportError, ValueError):  # no `megatron` package at all
        return False


def worker_python() -> Path:
    return Path(os.environ.get("NEMO_RL_VENV_DIR") or DEFAULT_VENV_DIR) / MEGATRON_WORKER / "bin" / "python"


def nemo_rl_dir() -> Path:
    return Path(os.environ.get("NEMO_RL_DIR") or DEFAULT_NEMO_RL_DIR)


def megatron_python() -> list[str] | None:
    """Command prefix of another Python with Megatron-Bridge; None when this one has it, or when none is
    found (the export then fails in this process, saying where it looked)."""
    if has_megatron_bridge():
        return None
    if worker_python().is_file():
        return [str(worker_python())]
    uv = shutil.which("uv")
    if uv and (nemo_rl_dir() / "pyproject.toml").is_file():
        return [uv, "run", "--locked", "--extra", "mcore", "--directory", str(nemo_rl_dir()), "python"]
    return None


def where_looked() -> str:
    return f"the Megatron worker venv {worker_python()} and `uv` with NeMo-RL's source in {nemo_rl_dir()}"


def rerun_with(python: list[str], cli_args: list[str]) -> int:
    """Run ``bapo-nemo <cli_args>`` with `python` (paths in `cli_args` must be absolute: ``uv run
    --directory`` changes the working directory) and return its exit code."""
    package_root = str(Path(__file__).resolve().parents[2])  # bapo_nemo comes from here, as in this process
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env[CHILD_ENV] = "1"
    print(f"this Python has no Megatron-Bridge: exporting with {' '.join(python)}", flush=True)
    return subprocess.run([*python, "-m", "bapo_nemo.cli", *cli_args], env=env, check=False).returncode


def in_rerun() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def _absolute(path: str | Path) -> str:
    return str(Path(path).expanduser().absolute())


def export_cli_args(args) -> list[str]:
    """The `bapo-nemo export` command line of `args` (an argparse Namespace), with absolute paths."""
    argv = ["export", _absolute(args.checkpoint), "--out", _absolute(args.out)]
    if args.force:
        argv.append("--force")
    if args.register_model:
        argv += ["--register-model", args.register_model]
    if args.tracking_uri:
        uri = args.tracking_uri
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):  # a relative database file
            uri = "sqlite:///" + _absolute(uri.removeprefix("sqlite:///"))
        argv += ["--tracking-uri", uri]
    if args.parity_prompts is not None:
        argv += ["--parity-prompts", _absolute(args.parity_prompts)]
    return argv

