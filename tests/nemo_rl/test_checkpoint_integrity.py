"""Damaged checkpoints and a full disk through the installed NeMo-RL's real CheckpointManager (run from its
source in a child process): resume from the newest intact checkpoint, the damaged one moved aside at the
next save, and a save into a full disk recognised (the checkpoints: tests/support/checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

from bapo_nemo.nemo.checkpoint_integrity import damage
from bapo_nemo.nemo.partial_rollout import STATE_FILE
from tests.support.checkpoints import WEIGHTS, largest_shard, truncate, write_step
from tests.support.nemo_rl_source import run_with_nemo_rl

REPO = Path(__file__).resolve().parents[2]


# ---- NeMo-RL's CheckpointManager, both trees -----------------------------------------------------------
_NEMO_IMPORTS = """
from nemo_rl.utils.checkpoint import CheckpointManager
"""


_NEMO_PRELUDE = """
import contextlib, io, json, os, shutil, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from bapo_nemo.nemo.checkpoint_integrity import damage, skipping_damaged, disk_full_line, no_space_left
root, weights = Path({root!r}), Path({weights!r})
config = dict(checkpoint_dir=str(root), metric_name=None, higher_is_better=True, keep_top_k=1, save_optimizer=True,
              save_period=1)

def finalize(manager, path, wait_fn=None):
    if hasattr(manager, "begin_finalization"):  # main: the rename runs on a background thread
        manager.begin_finalization(path, wait_fn=wait_fn)
        manager.finalize_pending()
        manager.shutdown()  # and the pruning queued after the rename
    else:
        manager.finalize_checkpoint(path)

def save(manager, step):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        path = Path(manager.init_tmp_checkpoint(step, {{"current_step": step, "total_steps": step}}))
        shutil.copytree(weights, path / "policy" / "weights")
        finalize(manager, path)
    return out.getvalue()
"""


def _nemo(body: str, **values) -> dict:
    prelude = _NEMO_PRELUDE.format(repo=str(REPO), **{k: str(v) for k, v in values.items()})
    return run_with_nemo_rl(_NEMO_IMPORTS, prelude + body)


def test_nemo_rl_resumes_from_the_newest_intact_and_moves_the_damaged_one_aside_at_the_next_save(tmp_path, weights):
    root = tmp_path / "ckpt"
    for n in (1, 2, 3):
        write_step(root / f"step_{n}", weights, n)
    shard = largest_shard(root / "step_3")
    cut_size = shard.stat().st_size - 1
    truncate(shard, cut_size)
    reason = damage(root / "step_3")
    result = _nemo(
        """
out = io.StringIO()
manager = skipping_damaged(CheckpointManager)(config)
with contextlib.redirect_stdout(out):
    latest = manager.get_latest_checkpoint_path()
    again = manager.get_latest_checkpoint_path()
info = manager.load_training_info(latest)
untouched = sorted(p.name for p in root.iterdir())
saved = save(manager, 3)  # the run reaches step 3 again; keep_top_k=1 prunes the others
print(json.dumps(dict(latest=latest, again=again, info=info, lines=out.getvalue(), untouched=untouched,
                      saved=saved, after=sorted(p.name for p in root.iterdir()),
                      latest_after=manager.get_latest_checkpoint_path(), step_3=damage(root / "step_3"))))
""", root=root, weights=weights)
    assert result["latest"] == result["again"] == str(root / "step_2") and result["info"]["current_step"] == 2
    assert result["lines"] == (f"checkpoint {root / 'step_3'} is damaged ({reason}): skipped and left in place; "
                               f"resuming from {root / 'step_2'}\n")  # once, though asked twice
    assert result["untouched"] == ["step_1", "step_2", "step_3"]
    assert (f"checkpoint {root / 'step_3'} is damaged ({reason}): moved to {root / 'damaged_step_3'} before the "
            "checkpoint of step 3 is saved") in result["saved"]
    assert result["after"] == ["damaged_step_3", "step_3"]  # pruned to top-1; the damaged one is kept
    assert result["latest_after"] == str(root / "step_3") and result["step_3"] is None
    assert damage(root / "damaged_step_3") == reason  # the same bytes, not a copy made good
    assert (root / "damaged_step_3" / WEIGHTS / shard.name).stat().st_size == cut_size


def test_without_the_subclass_nemo_rl_resumes_from_the_damaged_one_and_deletes_it(tmp_path, weights):
    """The control: what upstream alone does with the same directory."""
    root = tmp_path / "ckpt"
    for n in (1, 2):
        write_step(root / f"step_{n}", weights, n)
    truncate(root / "step_2" / STATE_FILE, 7)
    result = _nemo(
        """
manager = CheckpointManager(config)
latest = manager.get_latest_checkpoint_path()
save(manager, 2)
print(json.dumps(dict(latest=latest, after=sorted(p.name for p in root.iterdir()))))
""", root=root, weights=weights)
    assert result["latest"] == str(root / "step_2") and result["after"] == ["step_2"]


def test_nemo_rl_after_a_save_into_a_full_disk(small_disk, weights, tmp_path):
    root = small_disk / "ckpt"
    result = _nemo(
        """
sys.path.insert(0, {repo!r})
from tests.support.megatron_checkpoint_writer import save_weights
manager = skipping_damaged(CheckpointManager)(config)
save(manager, 1)
tmp = Path(manager.init_tmp_checkpoint(2, {"current_step": 2}))
reports = save_weights(tmp / "policy/weights/iter_0000000", world=2, floats=200_000, report={report!r})
failed = dict(reports=reports, latest=manager.get_latest_checkpoint_path(), line=disk_full_line(root, manager),
              left=sorted(p.name for p in root.iterdir()))
async_error = None
if hasattr(manager, "begin_finalization"):  # main: an async save's failure comes out of wait_fn
    def wait_fn():
        (tmp / "more").write_bytes(b"x" * (1 << 20))
    try:
        finalize(manager, tmp, wait_fn)
    except RuntimeError as exc:
        async_error = dict(text=str(exc), no_space_left=no_space_left(exc))
failed.update(async_error=async_error, after_async=sorted(p.name for p in root.iterdir()))
shutil.rmtree(root / "step_1" / "policy")  # space freed; the next attempt at step 2:
out = io.StringIO()
with contextlib.redirect_stdout(out):
    again = Path(manager.init_tmp_checkpoint(2, {"current_step": 2}))
failed.update(retry=out.getvalue(), retry_files=sorted(p.name for p in again.iterdir()))
print(json.dumps(failed))
""".replace("{repo!r}", repr(str(REPO))).replace("{report!r}", repr(str(tmp_path / "report"))),
        root=root, weights=weights)
    assert result["reports"] and all(r["no_space_left_here"] for r in result["reports"]), result["reports"]
    assert result["latest"] == str(root / "step_1")
    assert result["left"] == ["step_1", "tmp_step_2"]
    assert result["line"].startswith("error: the checkpoint save of step 2 failed: no space left on device under ")
    assert f"{root / 'tmp_step_2'} is incomplete and is never resumed from; newest complete checkpoint: " \
           f"{root / 'step_1'}." in result["line"]
    if result["async_error"] is not None:  # main: nothing renamed after the failed wait, the error re-raised
        assert result["async_error"] == {"text": "Background checkpoint finalization failed", "no_space_left": True}
    assert result["after_async"] == ["step_1", "tmp_step_2"]
    assert result["retry"] == f"removed {root / 'tmp_step_2'}, left incomplete by an interrupted save of step 2\n"
    assert result["retry_files"] == ["training_info.json"]
