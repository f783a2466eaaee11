"""Paths a NeMo-RL v0.7.0 config names that must exist before a cluster job starts (the model, the
tokenizer, data and prompt files), resolved as NeMo-RL resolves them (relative prompt files against the job's working directory)."""

from __future__ import annotations

from pathlib import Path

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding

# Where nvcr.io/nvidia/nemo-rl:v0.7.0 holds NeMo-RL's source (its examples/prompts/ included).
NEMO_RL_IMAGE_SOURCE = "/opt/nemo-rl"


def data_files(config: dict) -> list[tuple[str, str, bool]]:
    """(key, path, opened as a file) of every data path in `data:`. Prompt files are opened by v0.7.0's
    `TaskDataSpec.__post_init__` with a plain `os.path.exists`/`open`, so a relative one resolves against
    the driver's working directory; `data_path` may also be a Hugging Face dataset name."""
    found = []
    default = get(config, "data.default")
    sections = [("data.default", default if isinstance(default, dict) else None)]
    for section in ("train", "validation"):
        entries = get(config, f"data.{section}")
        if isinstance(entries, list):
            sections += [(f"data.{section}[{i}]", e) for i, e in enumerate(entries)]
        else:
            sections.append((f"data.{section}", entries))
    for where, entry in sections:
        if not isinstance(entry, dict):
            continue
        for name in ("prompt_file", "system_prompt_file"):
            if isinstance(entry.get(name), str) and entry[name]:
                found.append((f"{where}.{name}", entry[name], True))
        if isinstance(entry.get("data_path"), str) and entry["data_path"]:
            found.append((f"{where}.data_path", entry["data_path"], False))
    return found


def path_rules(config: dict, workdir: Path) -> list[Finding]:
    """Paths that must exist before the job starts, resolved as NeMo-RL will resolve them: relative prompt
    files against `workdir`, the job's working directory (slurm/bapo_32b.sbatch: the checkout)."""
    f: list[Finding] = []
    candidates = [
        ("policy.model_name", get(config, "policy.model_name"), False),
        ("policy.tokenizer.name", get(config, "policy.tokenizer.name"), False),
        *data_files(config),
    ]
    in_image = Path(NEMO_RL_IMAGE_SOURCE).is_dir()  # false outside the container: those paths are unknowable
    for key, path, is_file in candidates:
        if not isinstance(path, str):
            continue
        if not path.startswith("/"):
            if is_file and not (workdir / path).exists():
                f.append(
                    Finding(
                        "error",
                        key,
                        f"{path} is relative: NeMo-RL opens it from the job's working directory, where "
                        f"{workdir / path} does not exist; use an absolute path (NeMo-RL's own prompts: "
                        f"{NEMO_RL_IMAGE_SOURCE}/examples/prompts/...)",
                    )
                )
            continue
        if Path(path).exists():
            continue
        if path.startswith(NEMO_RL_IMAGE_SOURCE + "/") and not in_image:
            f.append(Finding("warning", key, f"{path} is inside the NeMo-RL image; not checked outside it"))
        else:
            f.append(
                Finding("error", key, f"{path} does not exist (mount it into the container or fix the path)")
            )
    ckpt = get(config, "checkpointing.checkpoint_dir")
    if isinstance(ckpt, str) and ckpt.startswith("/") and not Path(ckpt).parent.exists():
        f.append(Finding("warning", "checkpointing.checkpoint_dir", f"parent of {ckpt} does not exist here"))
    return f
