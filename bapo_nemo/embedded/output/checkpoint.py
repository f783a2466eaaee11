"""Checkpoints of the embedded trainer, in the layout other tools read (docs/embedded.md, "Output directory").

`<output_dir>/checkpoints/step_<N>/`: `model/` (HF, tokenizer included), `tokenizer/`, `trainer_state.pt`,
`rollout_state.json`, `config.yaml`, `training_info.json` (with the other files' SHA-256) and `COMPLETE`,
written last; `checkpoints/latest`; `hf_final/`. A checkpoint is written to a temporary directory and
renamed into place; before a resume trusts one, every file must read and belong to it (`checkpoint_problem`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

from bapo_nemo.embedded.model.tokenizer import save_inference_tokenizer, save_tokenizer
from bapo_nemo.tracking.redact import redact_nested

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory and what to do."""


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete step directories, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint. `latest` is a hint; the COMPLETE markers are the truth (a crash
    between the rename and the update of `latest` must not hide the newest checkpoint)."""
    complete = complete_checkpoints(output_dir)
    return complete[-1] if complete else None


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why a complete checkpoint cannot be resumed from (a file truncated or corrupted after it was
    written, e.g. by a full disk or a partial copy), or None when every file it is resumed from reads."""
    for name in ("config.yaml", "training_info.json", "rollout_state.json", "trainer_state.pt"):
        if not (ckpt / name).is_file():
            return f"{name} is missing"
    try:
        yaml.safe_load((ckpt / "config.yaml").read_text())
        json.loads((ckpt / "training_info.json").read_text())
        json.loads((ckpt / "rollout_state.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        return f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    # torch.save writes a zip archive: the CRC of every member is checked without unpickling anything
    try:
        with zipfile.ZipFile(ckpt / "trainer_state.pt") as archive:
            bad = archive.testzip()
        if bad is not None:
            return f"trainer_state.pt is corrupted (member {bad} fails its CRC)"
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        return f"trainer_state.pt is truncated or corrupted ({exc})"
    return weights_problem(ckpt / "model") or _consistency_problem(ckpt)


def weights_problem(model_dir: Path) -> str | None:
    """Why the safetensors weights of a saved model cannot be loaded (none, or one truncated), or None."""
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        return f"{model_dir.name}/ holds no *.safetensors weights"
    for path in weights:
        problem = _safetensors_problem(path)
        if problem:
            return f"{model_dir.name}/{path.name} {problem}"
    return None


def _consistency_problem(ckpt: Path) -> str | None:
    """Whether files that each read belong together: the step of the directory, of training_info.json and
    of trainer_state.pt agree, and every file recorded with a SHA-256 still has it (a file copied in from
    another step or another run is intact, and wrong)."""
    info = json.loads((ckpt / "training_info.json").read_text())
    match = _STEP_DIR.match(ckpt.name)
    step = int(match.group(1)) if match else info.get("step")
    if info.get("step") != step:
        return f"training_info.json is of step {info.get('step')}, not of {ckpt.name}"
    digests = info.get("sha256") or {}
    try:  # mmap: the step and version are read without loading the optimizer's tensors
        state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure makes the checkpoint unusable
        return f"trainer_state.pt is unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    if state.get("step") != step or state.get("policy_version") != info.get("policy_version"):
        return (f"trainer_state.pt belongs to step {state.get('step')} (policy version {state.get('policy_version')}), "
                f"not to {ckpt.name} (policy version {info.get('policy_version')}): it was copied in from another "
                "checkpoint or run")
    for name, digest in digests.items():  # recorded since checkpoints carry them: catches same-step swaps
        if not (ckpt / name).is_file() or _sha256(ckpt / name) != digest:
            return (f"{name} is not the file this checkpoint was saved with (its SHA-256 differs from the one in "
                    "training_info.json): it was copied in from another checkpoint or run")
    return None


# The files a checkpoint is resumed from, fingerprinted in training_info.json.
_FINGERPRINTED = ("trainer_state.pt", "rollout_state.json", "config.yaml")


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def latest_intact_checkpoint(output_dir: str | Path, report=None) -> Path | None:
    """The newest complete checkpoint whose files all read; each newer one skipped is passed to
    ``report(path, why)``. Raises CheckpointError when checkpoints exist but none is intact (starting
    afresh would write over them)."""
    complete = complete_checkpoints(output_dir)
    skipped = []
    for ckpt in reversed(complete):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        skipped.append(f"{ckpt.name}: {problem}")
        if report is not None:
            report(ckpt, problem)
    if skipped:
        raise CheckpointError(
            f"no intact checkpoint in {checkpoints_dir(output_dir)} ({'; '.join(skipped)}): restore one "
            "from a copy, or start a new run in another --output-dir"
        )
    return None


def _safetensors_problem(path: Path) -> str | None:
    """Header and size of a safetensors file agree (a truncated file fails here)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                return f"is truncated (header length {header_len}, file size {size})"
            header = json.loads(fh.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        return f"has an unreadable header ({exc})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        described = 8 + header_len + end
        return f"is truncated or corrupted (the header describes {described} bytes, the file has {size})"
    return None


def respect_umask(root: Path) -> None:
    """HF's atomic saves create 0600 files; give them the permissions of the user's umask instead, so
    teammates on a shared filesystem can read the weights."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def save_model(model, path: str | Path) -> None:
    """HF `save_pretrained` without its per-save progress bar (one per checkpoint clutters the logs)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(path), safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    respect_umask(Path(path))


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model,
    tokenizer,
    trainer_state: dict[str, Any],
    rollout_state: dict[str, Any],
    config_dict: dict[str, Any],
    training_info: dict[str, Any],
    keep_last: int,
) -> Path:
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with disk_full_is_named(f"checkpoint {final}", tmp):
        save_model(model, tmp / "model")
        save_inference_tokenizer(tokenizer, tmp / "model")  # beside the weights: one directory to load
        save_tokenizer(tokenizer, tmp / "tokenizer")
        _torch_save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "rollout_state.json").write_text(json.dumps(rollout_state))
        (tmp / "config.yaml").write_text(yaml.safe_dump(redact_nested(config_dict), sort_keys=False))
        sha256 = {name: _sha256(tmp / name) for name in _FINGERPRINTED}
        (tmp / "training_info.json").write_text(json.dumps(redact_nested({**training_info, "sha256": sha256}),
                                                           indent=2))
        _fsync_tree(tmp)
        (tmp / COMPLETE).write_text(f"step {step}\n")
    replace_dir(tmp, final)  # re-saving a step (e.g. a signal right after a resume) replaces it whole
    _write_atomic(root / "latest", final.name + "\n")
    _prune(output_dir, keep_last)
    return final


def replace_dir(new: Path, target: Path) -> None:
    """Put directory ``new`` at ``target``, replacing whatever directory is there whole (the caller owns
    ``target``: it holds the run's lock). Never half of one and half of the other."""
    if target.exists():
        old = target.with_name(f".old_{target.name}_{os.getpid()}")
        os.replace(target, old)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)


class _WriteErrors:
    """A file for torch.save that keeps the OSError of a failed write: torch reports it only as
    "unexpected pos N vs M"."""

    def __init__(self, fh):
        self.fh, self.error = fh, None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as fh:
        writer = _WriteErrors(fh)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(exc)  # safetensors' SafetensorError words it so


@contextmanager
def disk_full_is_named(what: str, partial: Path):
    """A full disk while writing ``what`` ends in one line that says so, with the partial directory removed
    and what was written before untouched."""
    try:
        yield
    except Exception as exc:
        if not _is_disk_full(exc):
            raise
        shutil.rmtree(partial, ignore_errors=True)
        free = shutil.disk_usage(partial.parent).free
        raise CheckpointError(
            f"no space left on device while writing {what} ({free / 2**20:.1f} MiB free on the disk of "
            f"{partial.parent}): free space or move the run to a larger disk, then continue with --resume "
            "(the checkpoints written before are intact)"
        ) from None


def final_model_step(final: Path) -> int | None:
    """The step of the model in ``hf_final`` (from its COMPLETE marker), or None without a complete one."""
    try:
        return int((final / COMPLETE).read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def save_final_model(model, tokenizer, final: Path, step: int, card: str | None = None) -> None:
    """``hf_final``: the model and the tokenizer for inference (and `card` as its README.md), written beside
    it and renamed into place, so it always holds one whole model, of the step its COMPLETE names."""
    for leftover in final.parent.glob(f".{final.name}.tmp*"):  # of a process that died while writing it
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    with disk_full_is_named(f"the final model {final}", tmp):
        save_model(model, tmp)
        save_inference_tokenizer(tokenizer, tmp)
        if card is not None:
            (tmp / "README.md").write_text(card)
        _fsync_tree(tmp)
        (tmp / COMPLETE).write_text(f"step {step}\n")
    replace_dir(tmp, final)


def load_training_info(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / "training_info.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{ckpt}/training_info.json is unreadable ({exc}); delete {ckpt} to fall back "
            "to the previous checkpoint"
        ) from None


def load_config_dict(ckpt: Path) -> dict[str, Any]:
    try:
        return yaml.safe_load((ckpt / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{ckpt}/config.yaml is unreadable ({exc})") from None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    # Our own file: it holds RNG states (numpy/python objects), hence weights_only=False.
    return torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)


def load_rollout_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "rollout_state.json").read_text())


def _prune(output_dir: str | Path, keep_last: int) -> None:
    complete = complete_checkpoints(output_dir)
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    # Leftovers of crashed saves of this or earlier processes.
    for child in checkpoints_dir(output_dir).iterdir():
        if child.name.startswith((".tmp_step_", ".old_step_")) and not child.name.endswith(f"_{os.getpid()}"):
            shutil.rmtree(child, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
