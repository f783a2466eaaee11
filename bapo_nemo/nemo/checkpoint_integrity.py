"""Damaged checkpoints and a full disk on the NeMo-RL path: resume from the newest intact `step_N`.

NeMo-RL resumes from the highest `step_N` without looking inside it. `damage(step_dir)` judges one from
sizes and small metadata files (no tensor is read); `skipping_damaged(CheckpointManager)`, put in place of
grpo's name, resumes the newest intact one and moves each damaged newer one to `damaged_step_N` at the
first save (never loaded, never deleted); `no_space_left` / `disk_full_line` end a failed save in one line.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

_STEP = re.compile(r"step_(\d+)")
_TMP_STEP = re.compile(r"tmp_step_(\d+)")
DAMAGED_PREFIX = "damaged_"  # NeMo-RL globs `step_*` (fullmatch `step_\d+`): `damaged_step_N` is never read
TRAINING_INFO = "training_info.json"
# Megatron-Bridge's layout under policy/weights: iter_NNNNNNN/ (megatron-core torch_dist) and a tracker file
_MEGATRON_ITERATION = re.compile(r"iter_\d{7}")
_MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_MEGATRON_METADATA = "metadata.json"  # megatron-core's dist_checkpointing format marker (load needs it)
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint: written last, once every shard is written


# ---- what is wrong with one checkpoint ------------------------------------------------------------------
def damage(checkpoint: Path) -> str | None:
    """None when `checkpoint` looks complete, else one clause naming the file and what is wrong."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / TRAINING_INFO).is_file():
        return f"{TRAINING_INFO} is missing"
    for directory, dirnames, filenames in os.walk(checkpoint):
        dirnames.sort()
        here = Path(directory)
        problem = _dcp_damage(here, set(filenames)) or _megatron_damage(here, set(filenames))
        for name in sorted(filenames):
            problem = problem or _file_damage(here / name)
        if problem:
            return problem.replace(f"{checkpoint}{os.sep}", "")
    return None


def _file_damage(path: Path) -> str | None:
    if path.suffix == ".json":
        try:
            json.loads(path.read_bytes())
        except (ValueError, OSError) as exc:
            return f"{path} does not parse as JSON ({exc})"
    elif path.suffix == ".pt":  # torch.save's zip archive (train_dataloader.pt, common.pt, replay_buffer.pt)
        return _zip_damage(path)
    return None


def _zip_damage(path: Path) -> str | None:
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return f"{path} is not a complete torch.save archive ({exc}; {size} bytes)"
    for member in members:  # the central directory survived: every member must lie inside the file
        if member.header_offset + member.compress_size > size:
            return f"{path} is truncated ({size} bytes; member {member.filename} ends past it)"
    return None


def _dcp_damage(directory: Path, files: set[str]) -> str | None:
    """A torch distributed checkpoint directory: its metadata reads and every shard holds its items."""
    if _DCP_METADATA not in files:
        if any(f.endswith(".distcp") for f in files):
            return f"{directory / _DCP_METADATA} is missing (the distributed checkpoint was never finalised)"
        return None
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # noqa: BLE001 (a cut pickle raises anything from EOFError to UnpicklingError)
        return f"{directory / _DCP_METADATA} does not read ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for item in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(item, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(item.offset) + int(item.length))
    for name, end in sorted(needed.items()):
        shard = directory / name
        if not shard.is_file():
            return f"{shard} is missing"
        size = shard.stat().st_size
        if size < end:
            return f"{shard} is truncated ({size} bytes, its items need {end})"
    return None


def _megatron_damage(directory: Path, files: set[str]) -> str | None:
    """Megatron-Bridge's weights layout: each iter_NNNNNNN holds megatron-core's metadata.json, and the
    tracker (where present) names an iteration that exists."""
    if _MEGATRON_ITERATION.fullmatch(directory.name) and _MEGATRON_METADATA not in files:
        return f"{directory / _MEGATRON_METADATA} is missing"
    if _MEGATRON_TRACKER in files:
        text = (directory / _MEGATRON_TRACKER).read_bytes().decode(errors="replace").strip()
        if text != "release" and not (text.isdigit() and (directory / f"iter_{int(text):07d}").is_dir()):
            return f"{directory / _MEGATRON_TRACKER} names no iteration here ({text!r})"
    return None


# ---- the newest intact one ---------------------------------------------------------------------------
def step_dirs(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The `step_N` directories NeMo-RL would resume from, newest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)]
    return sorted(steps, key=lambda p: int(p.name.split("_")[1]), reverse=True)


def newest_intact(checkpoint_dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest intact `step_N` or None, [(damaged newer step_N, why), ...] newest first)."""
    damaged: list[tuple[Path, str]] = []
    for step_dir in step_dirs(checkpoint_dir):
        reason = damage(step_dir)
        if reason is None:
            return step_dir, damaged
        damaged.append((step_dir, reason))
    return None, damaged


def set_aside_name(step_dir: Path) -> Path:
    """`damaged_step_N` beside it (`damaged_step_N.2`, ... when that exists already)."""
    target = step_dir.with_name(DAMAGED_PREFIX + step_dir.name)
    copy = 2
    while target.exists():
        target = step_dir.with_name(f"{DAMAGED_PREFIX}{step_dir.name}.{copy}")
        copy += 1
    return target


def _note_damaged(state: dict, damaged: list, intact: Path | None) -> None:
    """Remember each damaged checkpoint in the manager's `state` and name it once, with what is resumed."""
    reported = state.setdefault("_damaged", {})
    for path, reason in damaged:
        state.setdefault("_damaged_seen", set()).add(path)
        if path not in reported:
            reported[path] = reason
            print(
                f"checkpoint {path} is damaged ({reason}): skipped and left in place; resuming "
                f"from {intact if intact is not None else 'the start'}",
                flush=True,
            )


def skipping_damaged(manager_cls: type) -> type:
    """A subclass of NeMo-RL's CheckpointManager that resumes from the newest intact checkpoint."""
    if getattr(manager_cls, "skips_damaged", False):
        return manager_cls

    class IntactCheckpointManager(manager_cls):
        skips_damaged = True

        def get_latest_checkpoint_path(self) -> str | None:
            names = tuple(p.name for p in step_dirs(self.checkpoint_dir))
            cached = self.__dict__.get("_intact_cache")
            if cached is None or cached[0] != names:
                intact, damaged = newest_intact(self.checkpoint_dir)
                self._intact_cache = cached = (names, intact)
                _note_damaged(self.__dict__, damaged, intact)
            return None if cached[1] is None else str(cached[1])

        def init_tmp_checkpoint(self, step, *args, **kwargs):
            self._set_aside_damaged(step)
            stale = Path(self.checkpoint_dir) / f"tmp_step_{step}"
            if stale.exists():  # main removes it too; v0.7.0 would write into the interrupted save's files
                shutil.rmtree(stale)
                print(f"removed {stale}, left incomplete by an interrupted save of step {step}", flush=True)
            self._saving = Path(self.checkpoint_dir) / f"tmp_step_{step}"
            return super().init_tmp_checkpoint(step, *args, **kwargs)

        def _set_aside_damaged(self, step: int) -> None:
            """Before the run's first save: upstream would delete a damaged step_N of the same step at the
            rename, and prunes (and reads) every step_N. Moved, not deleted."""
            for path in list(self.__dict__.get("_damaged", {})):
                reason = self._damaged.pop(path)
                if path.is_dir():
                    target = set_aside_name(path)
                    os.rename(path, target)
                    print(
                        f"checkpoint {path} is damaged ({reason}): moved to {target} before the checkpoint of "
                        f"step {step} is saved (NeMo-RL would delete or prune it); inspect or delete it yourself",
                        flush=True,
                    )
            self._intact_cache = None

        def damaged_through(self) -> int | None:
            """The newest damaged step skipped at resume (its metrics were sent before it was damaged)."""
            steps = [int(p.name.split("_")[1]) for p in self.__dict__.get("_damaged_seen", ())]
            return max(steps, default=None)

        def unfinished_save(self) -> Path | None:
            """The `tmp_step_N` of this run's last save while it is not renamed yet."""
            saving = self.__dict__.get("_saving")
            return saving if saving is not None and saving.exists() else None

    IntactCheckpointManager.__qualname__ = IntactCheckpointManager.__name__ = f"Intact{manager_cls.__name__}"
    return IntactCheckpointManager


def skipped_damaged_through(checkpointer: Any) -> int | None:
    """The newest damaged checkpoint's step that `checkpointer` skipped at resume, or None."""
    return getattr(checkpointer, "damaged_through", lambda: None)()


def patch_grpo_checkpoint_manager(grpo_module: Any) -> None:
    """Put the subclass in place of `nemo_rl.algorithms.grpo.CheckpointManager` (setup() builds it)."""
    grpo_module.CheckpointManager = skipping_damaged(grpo_module.CheckpointManager)


# ---- a full disk ---------------------------------------------------------------------------------------
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("No space left on device", "Disk quota exceeded")


def _chain(exc: BaseException):
    """`exc`, its causes and contexts, Ray's remote cause (`RayTaskError.cause`), and torch DCP's per-rank
    failures (`CheckpointException.failures`: {rank: (exception, traceback)})."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        current = todo.pop()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__, getattr(current, "cause", None)]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]


def filesystem_full(directory: str | os.PathLike) -> bool:
    """Whether the filesystem holding `directory` is (nearly) full: under min(1 GiB, 1% of it) free."""
    usage = shutil.disk_usage(_existing(Path(directory)))
    return usage.free < min(1 << 30, usage.total // 100)


def no_space_left(exc: BaseException, directory: str | os.PathLike | None = None) -> bool:
    """Whether `exc` is a write that failed for lack of space: ENOSPC or EDQUOT anywhere in its chain
    (raised in the driver, or in a Ray actor: `RayTaskError.cause`), or in its text; or, where the error
    lost the errno (megatron-core's checkpoint writer reports a failed write by its type only, torch.save
    as 'unexpected pos'), `directory`'s filesystem is full."""
    for error in _chain(exc):
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            return True
        if any(text in str(error) for text in _FULL_TEXT):
            return True
    return directory is not None and filesystem_full(directory)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""  # pragma: no cover


def disk_full_line(checkpoint_dir: str | os.PathLike, checkpointer: Any = None) -> str:
    """The one line for a run stopped by a full disk: which save failed, what is left, what to do."""
    root = Path(checkpoint_dir)
    free = _size(shutil.disk_usage(_existing(root)).free)
    unfinished = getattr(checkpointer, "unfinished_save", lambda: None)()
    if unfinished is None:  # no checkpointer (the failure came before setup() built it): the newest tmp_step_N
        leftovers = [p for p in root.glob("tmp_step_*") if _TMP_STEP.fullmatch(p.name)] if root.is_dir() else []
        unfinished = max(leftovers, key=lambda p: int(p.name.split("_")[2]), default=None)
    complete, _ = newest_intact(root)
    newest = str(complete) if complete is not None else "none (a rerun starts from the beginning)"
    todo = (
        "Free space there (or move the checkpoints and point checkpointing.checkpoint_dir at the new place), "
        "then rerun the same command."
    )
    if unfinished is None:
        return f"error: no space left on device under {root} ({free} free); newest complete checkpoint: {newest}. {todo}"
    step = unfinished.name.split("_")[2]
    return (
        f"error: the checkpoint save of step {step} failed: no space left on device under {root} ({free} free). "
        f"{unfinished} is incomplete and is never resumed from; newest complete checkpoint: {newest}. {todo}"
    )
