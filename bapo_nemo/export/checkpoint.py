"""Finding and validating the checkpoint to export, before anything is loaded or written.

Two kinds, recognised by their layout:
- embedded: `<output_dir>/checkpoints/step_<N>/` with `model/`, `tokenizer/`, `training_info.json`,
  `config.yaml` and `COMPLETE`; `<output_dir>` or its `checkpoints/` picks the newest complete step.
- nemo_rl: NeMo-RL's `checkpoint_dir/step_<N>/` with `policy/weights` (Megatron torch_dist), `config.yaml`.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

_STEP = re.compile(r"^step_(\d+)$")
COMPLETE = "COMPLETE"


class ExportError(RuntimeError):
    """The checkpoint cannot be exported; the message names the file and the fix."""


@dataclass(frozen=True)
class CheckpointRef:
    kind: Literal["embedded", "nemo_rl"]
    path: Path  # the step directory
    step: int | None


def _step_of(path: Path) -> int | None:
    match = _STEP.match(path.name)
    return int(match.group(1)) if match else None


def _newest_complete(checkpoints: Path) -> Path:
    steps = sorted(
        (_step_of(p), p) for p in checkpoints.iterdir()
        if p.is_dir() and _step_of(p) is not None and (p / COMPLETE).is_file()
    )
    if not steps:
        partial = sorted(p.name for p in checkpoints.iterdir() if _step_of(p) is not None)
        raise ExportError(f"{checkpoints}: no complete checkpoint (a step_<N>/ with a COMPLETE marker)"
                          + (f"; partial ones: {', '.join(partial)}" if partial else ""))
    return steps[-1][1]


def resolve_checkpoint(path: str | Path) -> CheckpointRef:
    path = Path(path).resolve()
    if not path.exists():
        raise ExportError(f"{path} does not exist: pass a step_<N> checkpoint directory or a training output_dir")
    if (path / "policy" / "weights").exists():
        return CheckpointRef("nemo_rl", path, _step_of(path))
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.name == "checkpoints" and not (path / "model").exists():
        path = _newest_complete(path)
    if (path / "model").is_dir() or (path / "training_info.json").exists():
        return CheckpointRef("embedded", path, _step_of(path))
    raise ExportError(
        f"{path} is neither an embedded checkpoint (model/, tokenizer/, training_info.json) nor a NeMo-RL one "
        "(policy/weights, config.yaml)"
    )


def check_safetensors(path: Path) -> None:
    """Header and size of a safetensors file agree (a truncated copy fails here, naming the file)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8:
                raise ValueError(f"header length {header_len} exceeds the file size {size}")
            header = json.loads(fh.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ExportError(f"{path} is corrupted: unreadable safetensors header ({exc}); re-copy the file or "
                          "export an earlier checkpoint") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise ExportError(f"{path} is truncated or corrupted: the header describes {8 + header_len + end} bytes, "
                          f"the file has {size}; re-copy the file or export an earlier checkpoint")


def validate_embedded(ref: CheckpointRef) -> dict:
    """Check every file of contract 1 that an export reads; return training_info.json."""
    root = ref.path
    if not (root / COMPLETE).is_file():
        raise ExportError(f"{root}: no COMPLETE marker, so this checkpoint is partial (the trainer writes the marker "
                          "last); export an earlier step_<N> or let the trainer finish saving")
    required = ["model/config.json", "training_info.json", "config.yaml", "tokenizer"]
    for rel in required:
        if not (root / rel).exists():
            raise ExportError(f"{root / rel} is missing: the checkpoint is incomplete (contract: model/, tokenizer/, "
                              "config.yaml, training_info.json, COMPLETE)")
    weights = sorted((root / "model").glob("*.safetensors"))
    index = root / "model" / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ExportError(f"{index} is corrupted ({exc})") from None
        for shard in shards:
            if not (root / "model" / shard).is_file():
                raise ExportError(f"{root / 'model' / shard} is missing (listed in {index.name})")
        weights = [root / "model" / s for s in shards]
    if not weights:
        raise ExportError(f"{root / 'model' / 'model.safetensors'} is missing: no weights in {root / 'model'}")
    for file in weights:
        check_safetensors(file)
    if not any((root / "tokenizer" / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ExportError(f"{root / 'tokenizer' / 'tokenizer.json'} is missing: no tokenizer files in {root / 'tokenizer'}")
    for rel in ("model/config.json", "training_info.json"):
        try:
            json.loads((root / rel).read_text())
        except json.JSONDecodeError as exc:
            raise ExportError(f"{root / rel} is corrupted: not valid JSON ({exc})") from None
    return json.loads((root / "training_info.json").read_text())
