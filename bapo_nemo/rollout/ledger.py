"""What partial rollouts generated, durably, so a resume can count what a fault makes them generate again.

One fsync'd JSON line per segment iteration (the step it generates for, tokens, segments) in a file that
outlives attempts; a resume from `step_K` counts the lines of steps > K no earlier resume counted and
appends a resume line, so every line is counted at most once. A torn last line is dropped, any other bad
line reported once and not counted. docs/partial_rollouts.md ("What a fault costs") has the rules.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEDGER_FILE = "partial_rollouts_ledger.jsonl"

_GENERATION_FIELDS = ("step", "policy_version", "tokens", "segments", "finished")


@dataclass(frozen=True)
class Regenerated:
    """What an earlier attempt generated after `from_step` that no complete checkpoint holds."""

    from_step: int
    tokens: int
    segments: int
    iterations: int  # ledger lines counted

    def line(self) -> str:
        start = f"resumed from step_{self.from_step}" if self.from_step else "started from no checkpoint"
        after = f" after step_{self.from_step}" if self.from_step else ""
        return (
            f"{start}: {self.tokens} tokens in {self.segments} segments that an earlier attempt generated"
            f"{after} are generated again (partial rollouts)"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "partial_rollouts/regenerated_tokens": float(self.tokens),
            "partial_rollouts/regenerated_segments": float(self.segments),
            "partial_rollouts/resumed_from_step": float(self.from_step),
        }


class GenerationLedger:
    """Append-only JSON lines at `path`: `generation` records, one per segment iteration, and `resume`
    records, one per resume."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._tail_checked = False

    def record(self, step: int, policy_version: int, tokens: int, segments: int, finished: int) -> None:
        """One segment iteration: `segments` responses got `tokens` new tokens for training step `step`
        (completed trains + 1) from policy `policy_version`; `finished` of them ended."""
        self._append({"kind": "generation", "step": step, "policy_version": policy_version,
                      "tokens": tokens, "segments": segments, "finished": finished})

    def resume(self, from_step: int) -> Regenerated | None:
        """A new attempt starts from checkpoint `step_{from_step}` (0: from no checkpoint). Counts the
        generation no complete checkpoint holds and records the resume; None for a first start (no
        checkpoint and nothing generated before)."""
        uncounted = self.uncounted()
        lost = [e for e in uncounted if e["step"] > from_step]
        if from_step == 0 and not lost:
            return None
        regenerated = Regenerated(
            from_step=from_step,
            tokens=sum(e["tokens"] for e in lost),
            segments=sum(e["segments"] for e in lost),
            iterations=len(lost),
        )
        self._append({"kind": "resume", "from_step": from_step, "regenerated_tokens": regenerated.tokens,
                      "regenerated_segments": regenerated.segments})
        return regenerated

    def uncounted(self) -> list[dict]:
        """Generation records no resume has counted yet, in file order."""
        pending: list[dict] = []
        for entry in self.entries():
            if entry["kind"] == "generation":
                pending.append(entry)
            else:  # a resume counted (and so consumed) every earlier line past its checkpoint
                pending = [e for e in pending if e["step"] <= entry["from_step"]]
        return pending

    def entries(self) -> list[dict]:
        """The valid records in file order. A torn last line (the writer was killed) is skipped; any other
        bad line is reported on stderr, once per read, and skipped."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline
        out = []
        for number, raw in enumerate(lines, start=1):
            entry, problem = _parse(raw)
            if problem is None:
                out.append(entry)
            else:
                print(f"error: {self.path} line {number}: {problem}; the line is not counted as generated "
                      "tokens: fix or delete it", file=sys.stderr, flush=True)
        entry, problem = _parse(torn) if torn else (None, "empty")
        if problem is None:  # complete record, only its newline lost
            out.append(entry)
        return out

    # ---- writing --------------------------------------------------------------------------------------
    def _append(self, entry: Mapping[str, Any]) -> None:
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        created = not self.path.exists()
        if created:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self._tail_checked:
            self._end_last_line()
        self._tail_checked = True
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        if created:  # the new file's directory entry must survive a crash too
            _fsync_dir(self.path.parent)

    def _end_last_line(self) -> None:
        """Before this attempt's first append: a last line without its newline is ended when it is a whole
        record, and cut off when it is a fragment (a write the killed writer never finished)."""
        with open(self.path, "rb+") as f:
            data = f.read()
            if not data or data.endswith(b"\n"):
                return
            start = data.rfind(b"\n") + 1
            if _parse(data[start:])[1] is None:
                f.write(b"\n")
            else:
                f.truncate(start)
            f.flush()
            os.fsync(f.fileno())


def iteration_counts(before: Mapping[str, float], after: Mapping[str, float], group_size: int) -> dict:
    """tokens, segments and finished responses of the one segment iteration between two
    `PartialRolloutManager.stats` snapshots (no prompts added between them). A response in flight before
    it, or started by it (a group leaving the queue starts `group_size`), either is in flight after it or
    finished."""
    started = int(before["rollout/pending_prompts"] - after["rollout/pending_prompts"]) * group_size
    finished = int(before["rollout/in_flight_sequences"]) + started - int(after["rollout/in_flight_sequences"])
    return {
        "tokens": int(after["rollout/tokens_last_iteration"]),
        "segments": int(after["rollout/sequences_last_iteration"]),
        "finished": finished,
    }


def _parse(raw: bytes) -> tuple[dict | None, str | None]:
    """(record, None) for a valid line, else (None, why)."""
    try:
        entry = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"not JSON ({exc})"
    if not isinstance(entry, dict):
        return None, "not a JSON object"
    kind = entry.get("kind")
    fields = {"generation": _GENERATION_FIELDS, "resume": ("from_step",)}.get(kind)
    if fields is None:
        return None, f"kind {kind!r} is neither 'generation' nor 'resume'"
    for name in fields:
        value = entry.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return None, f"{kind} record's {name} must be an int >= 0, got {value!r}"
    return entry, None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory fds: the file's own fsync is what it offers
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
