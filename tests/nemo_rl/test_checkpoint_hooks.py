"""Our files in NeMo-RL's real checkpoints (bapo_nemo/nemo/checkpoint_hooks.py), on the installed NeMo-RL's
own `CheckpointManager`, finalised as its grpo_train finalises them: v0.7.0 renames `tmp_step_N` at once
(`finalize_checkpoint`); main renames it on a background thread once the async writes are done
(`begin_finalization(path, wait_fn=policy.finalize_async_save)`). The async writer here is a thread that
writes the weights file after a barrier the test releases: what NeMo-RL's `wait_fn` waits for."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from bapo_nemo.nemo.checkpoint_hooks import CheckpointHooks


def manager(root: Path):
    from nemo_rl.utils.checkpoint import CheckpointManager

    return CheckpointManager(
        {
            "checkpoint_dir": str(root),
            "metric_name": None,
            "higher_is_better": False,
            "keep_top_k": None,
            "save_optimizer": False,
            "save_period": 1,
        }
    )


def writer(name: str, calls: list, ok: bool = True):
    def write(tmp_dir: Path) -> bool:
        calls.append(Path(tmp_dir).name)
        if ok:
            (Path(tmp_dir) / name).write_text(f"{name} of {Path(tmp_dir).name}")
        return ok

    return write


class AsyncWeights:
    """A checkpoint's weights written on a thread after `release`, as an async Megatron save completes later."""

    def __init__(self, tmp_dir: Path):
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._write, args=(Path(tmp_dir),))
        self.thread.start()

    def _write(self, tmp_dir: Path) -> None:
        self.release.wait(timeout=60)
        (tmp_dir / "weights.bin").write_bytes(b"w")

    def wait(self) -> None:  # NeMo-RL's wait_fn (policy.finalize_async_save)
        self.thread.join()


def save(checkpointer, step: int, release_now: bool = True):
    """One checkpoint as the installed grpo_train writes it; returns the async writer (main) or None."""
    path = Path(checkpointer.init_tmp_checkpoint(step, {"step": step}, None))
    if not hasattr(checkpointer, "begin_finalization"):
        (path / "weights.bin").write_bytes(b"w")
        checkpointer.finalize_checkpoint(path)
        return None
    weights = AsyncWeights(path)
    checkpointer.begin_finalization(path, wait_fn=weights.wait)
    if release_now:
        weights.release.set()
        checkpointer.finalize_pending()
    return weights


def test_files_land_in_the_finalised_checkpoint_and_not_before(tmp_path):
    checkpointer = manager(tmp_path)
    calls: list[str] = []
    hooks = CheckpointHooks(checkpointer)
    hooks.add("partial_rollouts.json", writer("partial_rollouts.json", calls))
    hooks.add("parity_logprobs.json", writer("parity_logprobs.json", calls))
    hooks.install()

    weights = save(checkpointer, 1, release_now=False)
    if weights is not None:  # main: written, not yet renamed while the async save runs
        assert not (tmp_path / "step_1").exists()
        assert (tmp_path / "tmp_step_1" / "partial_rollouts.json").is_file()
        hooks.check()  # nothing finalised yet: nothing to say
        weights.release.set()
        checkpointer.finalize_pending()
    hooks.check()
    assert calls == ["tmp_step_1", "tmp_step_1"]
    step = tmp_path / "step_1"
    assert sorted(p.name for p in step.iterdir()) == [
        "parity_logprobs.json", "partial_rollouts.json", "training_info.json", "weights.bin"
    ]
    assert (step / "partial_rollouts.json").read_text() == "partial_rollouts.json of tmp_step_1"
    hooks.uninstall()
    assert checkpointer.init_tmp_checkpoint.__func__ is type(checkpointer).init_tmp_checkpoint


def test_a_checkpoint_finalised_past_the_hook_stops_the_run(tmp_path):
    """The silent failure on NeMo-RL main: checkpoints were finalised by a method our wrapper did not see.
    Here a checkpoint is made by the class's own method, past the instance's wrap."""
    from bapo_nemo.nemo.seams import SeamError

    checkpointer = manager(tmp_path)
    hooks = CheckpointHooks(checkpointer)
    hooks.add("partial_rollouts.json", writer("partial_rollouts.json", []))
    hooks.install()
    save(checkpointer, 1)
    hooks.check()

    path = type(checkpointer).init_tmp_checkpoint(checkpointer, 2, {"step": 2}, None)  # not through the wrap
    checkpointer.finalize_checkpoint(path)
    with pytest.raises(SeamError) as error:
        hooks.check()
    message = str(error.value)
    assert str(tmp_path / "step_2") in message and "partial_rollouts.json missing" in message
    assert "without passing through CheckpointManager.init_tmp_checkpoint" in message
    assert "NeMo-RL" in message and "tested NeMo-RL: v0.7.0" in message and "\n" not in message


def test_a_file_dropped_after_it_was_written_stops_the_run(tmp_path):
    from bapo_nemo.nemo.seams import SeamError

    checkpointer = manager(tmp_path)
    hooks = CheckpointHooks(checkpointer)
    hooks.add("parity_logprobs.json", writer("parity_logprobs.json", []))
    hooks.install()
    path = Path(checkpointer.init_tmp_checkpoint(1, {"step": 1}, None))
    (path / "parity_logprobs.json").unlink()  # e.g. a finaliser that copies only the files it knows
    checkpointer.finalize_checkpoint(path)
    with pytest.raises(SeamError, match=r"without them: parity_logprobs.json missing"):
        hooks.check()


def test_a_writer_that_could_not_write_is_not_required_and_old_checkpoints_are_not_checked(tmp_path):
    checkpointer = manager(tmp_path)
    old = tmp_path / "step_7"
    old.mkdir(parents=True)  # a checkpoint of an earlier run, from before our files existed
    hooks = CheckpointHooks(checkpointer)
    calls: list[str] = []
    hooks.add("parity_logprobs.json", writer("parity_logprobs.json", calls, ok=False))
    hooks.install()
    save(checkpointer, 8)
    hooks.check()  # step_7 is not ours; step_8's parity could not be recorded (said by the writer)
    assert calls == ["tmp_step_8"] and not (tmp_path / "step_8" / "parity_logprobs.json").exists()


def test_guard_checks_before_each_train(tmp_path):
    from bapo_nemo.nemo.seams import SeamError

    checkpointer = manager(tmp_path)
    hooks = CheckpointHooks(checkpointer)
    hooks.add("partial_rollouts.json", writer("partial_rollouts.json", []))
    hooks.install()
    trained: list[int] = []
    train = hooks.guard(lambda n: trained.append(n))
    save(checkpointer, 1)
    train(1)
    checkpointer.finalize_checkpoint(type(checkpointer).init_tmp_checkpoint(checkpointer, 2, {}, None))
    with pytest.raises(SeamError):
        train(2)
    assert trained == [1]  # the train after the bad checkpoint never ran
