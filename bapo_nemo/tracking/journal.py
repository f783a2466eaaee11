"""The fsync'd journal of one MLflow run: what was logged, in order, and how much the server accepted.

Per run: `<run_id>.jsonl` (records with a sequence number `seq`, appended and fsync'd before sending),
`<run_id>.cursor` (the last `seq` accepted), `<run_id>.artifacts/` (copies waiting for upload),
`<run_id>.rejected.jsonl` and `<run_id>.superseded.jsonl` (refused records, and metrics a resumed run
recomputes; both kept). Strictly ordered: a record is acknowledged only with every record before it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_COMPACT_AFTER = 1000  # acknowledged records kept in the file before it is rewritten without them


def _append_lines(path: Path, records: Iterable[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(record, allow_nan=True) + "\n" for record in records)
        fh.flush()
        os.fsync(fh.fileno())


def _replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a crash leaves the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_records(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a process killed mid-write) was never acknowledged."""
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {number + 1} is not JSON; fix or remove it") from None
    return records


class Journal:
    """Records of one run waiting for the server (``pending``, oldest first), kept on disk."""

    def __init__(self, directory: str | Path, run_id: str) -> None:
        self.directory = Path(directory)
        self.run_id = run_id
        self.pending: list[dict[str, Any]] = []
        self._next_seq = 1
        self._acknowledged_in_file = 0  # acknowledged records still in the file (compacted away later)
        self.load()

    @property
    def path(self) -> Path:
        return self.directory / f"{self.run_id}.jsonl"

    @property
    def cursor_path(self) -> Path:
        return self.directory / f"{self.run_id}.cursor"

    @property
    def staging_dir(self) -> Path:
        return self.directory / f"{self.run_id}.artifacts"

    @property
    def rejected_path(self) -> Path:
        return self.directory / f"{self.run_id}.rejected.jsonl"

    @property
    def superseded_path(self) -> Path:
        return self.directory / f"{self.run_id}.superseded.jsonl"

    def load(self) -> None:
        """Pick up the records an earlier process journaled and never got acknowledged."""
        self.directory.mkdir(parents=True, exist_ok=True)
        cursor = int(self.cursor_path.read_text().strip() or 0) if self.cursor_path.exists() else 0
        records = _read_records(self.path)
        self.pending = [r for r in records if r["seq"] > cursor]
        self._acknowledged_in_file = len(records) - len(self.pending)
        # Set-aside records left the file; their numbers stay used so the two files never share one.
        set_aside = [r["seq"] for r in _read_records(self.superseded_path)]
        self._next_seq = max([cursor, *(r["seq"] for r in records), *set_aside]) + 1

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Number the record, write it durably, queue it."""
        record = {"seq": self._next_seq, **record}
        self._next_seq += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        _append_lines(self.path, [record])
        self.pending.append(record)
        return record

    def acknowledge(self, count: int) -> None:
        """The server has the first ``count`` pending records: move the cursor past them."""
        done, self.pending = self.pending[:count], self.pending[count:]
        _replace_file(self.cursor_path, str(done[-1]["seq"]))
        for record in done:  # an uploaded copy is no longer needed once the cursor says so
            if record["kind"] == "artifact" and Path(record["path"]).parent.parent == self.staging_dir:
                shutil.rmtree(Path(record["path"]).parent, ignore_errors=True)
        self._acknowledged_in_file += len(done)
        if not self.pending or self._acknowledged_in_file >= _COMPACT_AFTER:
            self.compact()

    def compact(self) -> None:
        """Rewrite the file with only the pending records (empty when all are acknowledged)."""
        _replace_file(self.path, "".join(json.dumps(r, allow_nan=True) + "\n" for r in self.pending))
        self._acknowledged_in_file = 0
        if not self.pending and self.staging_dir.exists():
            shutil.rmtree(self.staging_dir, ignore_errors=True)

    def reject(self, record: dict[str, Any], error: str) -> Path:
        """Keep a record the server refuses for good beside the journal, with the error."""
        _append_lines(self.rejected_path, [{**record, "error": error[:2000]}])
        return self.rejected_path

    def set_aside(self, selects: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """Take the pending records ``selects`` picks out of the queue into ``<run_id>.superseded.jsonl``
        (written first, so a crash in between sets them aside again rather than losing them)."""
        chosen = [r for r in self.pending if selects(r)]
        if not chosen:
            return []
        already = {r["seq"] for r in _read_records(self.superseded_path)}
        _append_lines(self.superseded_path, [r for r in chosen if r["seq"] not in already])
        self.pending = [r for r in self.pending if not selects(r)]
        self.compact()
        return chosen
