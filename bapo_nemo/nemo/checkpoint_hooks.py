"""Our files in every NeMo-RL checkpoint, and the watch that stops a run whose checkpoints lack them.

NeMo-RL writes into `tmp_step_N` and renames it `step_N` once complete: synchronously on v0.7.0
(`finalize_checkpoint`), on a background thread on main (`begin_finalization`). Both first call
`CheckpointManager.init_tmp_checkpoint`, so that one method is wrapped: the registered writers (partial
rollouts in flight, parity log-probs) write into `tmp_step_N` and appear with the rename. `check()`, the
run-time half of seams.py, stops the run at the first `step_N` that did not pass through the wrap.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bapo_nemo.nemo.installed import TESTED_NEMO_RL, version_line
from bapo_nemo.nemo.seams import SeamError

# A writer puts its file into the given tmp_step_N directory; False when it could not and said why (a
# missing file the run can live with: the check does not require it then).
Writer = Callable[[Path], bool]

_STEP = re.compile(r"step_(\d+)")


class CheckpointHooks:
    """Writers for every checkpoint, through one wrap of `checkpointer.init_tmp_checkpoint`."""

    def __init__(self, checkpointer: Any):
        self.checkpointer = checkpointer
        self.checkpoint_dir = Path(checkpointer.checkpoint_dir)
        self.writers: dict[str, Writer] = {}
        self.written: dict[str, set[str]] = {}  # step_N -> files written into its tmp_step_N
        self.seen = self._finalised()  # checkpoints from before this run (a resume) are not ours to check
        self._original = None

    def add(self, filename: str, writer: Writer) -> None:
        self.writers[filename] = writer

    def install(self) -> CheckpointHooks:
        if self._original is not None:
            return self
        original = self._original = self.checkpointer.init_tmp_checkpoint

        def init_tmp_checkpoint(*args, **kwargs):
            path = Path(original(*args, **kwargs))
            written = self.written.setdefault(path.name.removeprefix("tmp_"), set())
            for filename, write in self.writers.items():
                if write(path):
                    written.add(filename)
            return path

        self.checkpointer.init_tmp_checkpoint = init_tmp_checkpoint
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            self.checkpointer.init_tmp_checkpoint = self._original
            self._original = None

    def _finalised(self) -> set[str]:
        if not self.checkpoint_dir.is_dir():
            return set()
        return {p.name for p in self.checkpoint_dir.iterdir() if p.is_dir() and _STEP.fullmatch(p.name)}

    def check(self) -> None:
        """Raise SeamError when a checkpoint finalised since the last check lacks a file of ours."""
        if not self.writers:
            return
        for name in sorted(self._finalised() - self.seen, key=lambda n: int(n.split("_")[1])):
            written = self.written.get(name)
            if written is None:
                missing, how = sorted(self.writers), "without passing through CheckpointManager.init_tmp_checkpoint"
            else:
                missing = sorted(f for f in written if not (self.checkpoint_dir / name / f).is_file())
                how = "after our files were written into its tmp_ directory, without them"
            if missing:
                raise SeamError(
                    f"{version_line()}: checkpoint {self.checkpoint_dir / name} was finalised {how}: "
                    f"{', '.join(missing)} missing. Stopped here so that no later checkpoint lacks them; "
                    f"run a tested NeMo-RL: {TESTED_NEMO_RL}"
                )
            self.seen.add(name)

    def guard(self, train_fn: Callable) -> Callable:
        """`policy.train` that checks the checkpoints first (the first train after a checkpoint's rename)."""

        def checked_train(*args, **kwargs):
            self.check()
            return train_fn(*args, **kwargs)

        return checked_train
