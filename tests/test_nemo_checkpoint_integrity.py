"""Damaged checkpoints and a full disk (issue 34, faults 5 and 6) on real megatron-core dist_checkpointing
saves (torch_dist, 2 gloo ranks on CPU: tests/megatron_checkpoint_writer.py), NeMo-RL's real
CheckpointManager (both trees, marked nemo_rl) and a real small tmpfs for the full disk."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo_nemo.nemo.checkpoint_integrity import damage, disk_full_line, newest_intact, no_space_left
from bapo_nemo.nemo.partial_rollout import STATE_FILE
from tests.nemo_rl_source import run_with_nemo_rl

REPO = Path(__file__).resolve().parent.parent
WEIGHTS = Path("policy/weights/iter_0000000")
pytest.importorskip("megatron.core", reason="megatron-core (the nemo-cpu extra) writes the checkpoints here")


def _write_step(step_dir: Path, weights_template: Path, step: int) -> None:
    """A step_N as NeMo-RL leaves it, with our partial-rollout file and the real Megatron weights."""
    shutil.copytree(weights_template, step_dir / "policy" / "weights")
    (step_dir / "training_info.json").write_text(json.dumps({"current_step": step, "total_steps": step}))
    (step_dir / "config.yaml").write_text("grpo:\n  max_num_steps: 10\n")
    (step_dir / STATE_FILE).write_text(json.dumps({"format_version": 1, "manager": {"in_flight": [[1, 2, 3]] * 50}}))
    torch.save({"sampler": list(range(100))}, step_dir / "train_dataloader.pt")


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """policy/weights of one real 2-rank megatron-core save (Megatron-Bridge layout)."""
    root = tmp_path_factory.mktemp("megatron")
    done = subprocess.run(
        [sys.executable, "-m", "tests.megatron_checkpoint_writer", str(root / "weights" / WEIGHTS.name), "2", "1000",
         str(root / "report")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[-1]) == [], done.stderr[-3000:]
    return root / "weights"


@pytest.fixture
def step(tmp_path, weights) -> Path:
    step_dir = tmp_path / "ckpt" / "step_1"
    _write_step(step_dir, weights, 1)
    return step_dir


def _largest_shard(step_dir: Path) -> Path:
    return max((step_dir / WEIGHTS).glob("*.distcp"), key=lambda p: (p.stat().st_size, p.name))


def _cut(path: Path, size: int) -> None:
    os.truncate(path, size)


def test_a_real_megatron_checkpoint_is_intact(step):
    files = {p.name for p in (step / WEIGHTS).iterdir()}
    assert {".metadata", "metadata.json"} <= files and len([f for f in files if f.endswith(".distcp")]) >= 2
    assert damage(step) is None


@pytest.mark.parametrize("cut", ["one byte", "half"])
def test_a_truncated_shard_is_named_with_the_bytes_its_items_need(step, cut):
    shard = _largest_shard(step)
    size = shard.stat().st_size  # torch DCP writes a shard's items back to back: the last one ends the file
    _cut(shard, size - 1 if cut == "one byte" else size // 2)
    expected = f"{WEIGHTS / shard.name} is truncated ({shard.stat().st_size} bytes, its items need {size})"
    assert damage(step) == expected


def test_a_missing_shard_and_an_unfinalised_save_are_named(step):
    shard = _largest_shard(step)
    shard.unlink()
    assert damage(step) == f"{WEIGHTS / shard.name} is missing"
    (step / WEIGHTS / ".metadata").unlink()  # what a save stopped before its coordinator finished leaves
    assert damage(step) == f"{WEIGHTS / '.metadata'} is missing (the distributed checkpoint was never finalised)"


def test_cut_metadata_is_named(step):
    metadata = step / WEIGHTS / ".metadata"
    _cut(metadata, metadata.stat().st_size // 2)
    assert damage(step).startswith(f"{WEIGHTS / '.metadata'} does not read (")
    (step / WEIGHTS / "metadata.json").unlink()
    assert damage(step).startswith(f"{WEIGHTS / '.metadata'} does not read (")  # the first problem found


def test_megatron_format_marker_missing_is_named(step):
    (step / WEIGHTS / "metadata.json").unlink()
    assert damage(step) == f"{WEIGHTS / 'metadata.json'} is missing"


@pytest.mark.parametrize("name", [STATE_FILE, "training_info.json"])
def test_a_cut_json_file_is_named(step, name):
    path = step / name
    _cut(path, path.stat().st_size - 1)
    assert damage(step).startswith(f"{name} does not parse as JSON (")


def test_missing_training_info_and_a_cut_torch_save_file_are_named(step):
    loader = step / "train_dataloader.pt"
    _cut(loader, loader.stat().st_size - 1)
    assert damage(step).startswith("train_dataloader.pt is not a complete torch.save archive (")
    (step / "training_info.json").unlink()
    assert damage(step) == "training_info.json is missing"


def test_newest_intact_skips_damaged_newer_ones(tmp_path, weights):
    root = tmp_path / "ckpt"
    for n in (1, 2, 3, 10):
        _write_step(root / f"step_{n}", weights, n)
    (root / "tmp_step_11").mkdir()  # an unfinished save is never a candidate
    shard = _largest_shard(root / "step_10")
    _cut(shard, 10)
    _cut(root / "step_3" / STATE_FILE, 5)
    intact, damaged = newest_intact(root)
    assert intact == root / "step_2"
    assert [(p.name, r.split(" ")[0]) for p, r in damaged] == [
        ("step_10", str(WEIGHTS / shard.name)), ("step_3", STATE_FILE)]
    for n in (1, 2):
        _cut(root / f"step_{n}" / "training_info.json", 3)
    assert newest_intact(root)[0] is None and len(newest_intact(root)[1]) == 4


# ---- a full disk: a real tmpfs -------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 256 KiB tmpfs (mount needs root; skipped, saying why, where it is refused)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (mount refused: {done.stderr.strip() or done.returncode})")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # lazy: a failed write may hold a file open


def test_enospc_in_the_driver_and_from_torch_save_is_recognised(small_disk):
    try:
        (small_disk / "big").write_bytes(b"x" * (1 << 20))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
        wrapped = RuntimeError("checkpoint failed")
        wrapped.__cause__ = exc
        assert no_space_left(exc) and no_space_left(wrapped)
    else:
        pytest.fail("1 MiB fitted into a 256 KiB tmpfs")
    (small_disk / "big").unlink()
    with pytest.raises(RuntimeError) as raised:  # torch.save's writer drops the errno ("unexpected pos")
        torch.save({"x": torch.zeros(1 << 18)}, small_disk / "x.pt")
    assert no_space_left(raised.value, small_disk)
    assert not no_space_left(ValueError("unrelated"), small_disk.parent)  # a disk with room: not this fault


def test_a_megatron_save_into_a_full_disk_is_recognised(small_disk, weights, tmp_path):
    from tests.megatron_checkpoint_writer import save_weights

    root = small_disk / "ckpt"
    _write_step(root / "step_1", weights, 1)
    tmp = root / "tmp_step_2"  # as init_tmp_checkpoint leaves it (with NeMo-RL's real one: the nemo_rl test)
    tmp.mkdir()
    (tmp / "training_info.json").write_text(json.dumps({"current_step": 2}))
    reports = save_weights(tmp / WEIGHTS, world=2, floats=200_000, report=tmp_path / "report")
    assert reports and all(r["no_space_left_here"] for r in reports), reports
    assert newest_intact(root) == (root / "step_1", [])
    assert disk_full_line(root) == (
        f"error: the checkpoint save of step 2 failed: no space left on device under {root} (0 B free). "
        f"{tmp} is incomplete and is never resumed from; newest complete checkpoint: {root / 'step_1'}. Free space "
        "there (or move the checkpoints and point checkpointing.checkpoint_dir at the new place), then rerun the "
        "same command."
    )


def test_enospc_raised_in_a_ray_actor_is_recognised(small_disk):
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Writer:
            def write(self, path):
                Path(path).write_bytes(b"x" * (1 << 20))

            def save(self, path):
                torch.save({"x": torch.zeros(1 << 18)}, path)

        writer = Writer.remote()
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            ray.get(writer.write.remote(str(small_disk / "f")), timeout=120)
        assert isinstance(raised.value, OSError) and raised.value.errno is None  # Ray's wrapper: no errno
        assert raised.value.cause.errno == errno.ENOSPC and no_space_left(raised.value)
        (small_disk / "f").unlink()
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            ray.get(writer.save.remote(str(small_disk / "x.pt")), timeout=120)
        assert not no_space_left(raised.value) and no_space_left(raised.value, small_disk)
    finally:
        ray.shutdown()


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


@pytest.mark.nemo_rl
def test_nemo_rl_resumes_from_the_newest_intact_and_moves_the_damaged_one_aside_at_the_next_save(tmp_path, weights):
    root = tmp_path / "ckpt"
    for n in (1, 2, 3):
        _write_step(root / f"step_{n}", weights, n)
    shard = _largest_shard(root / "step_3")
    cut_size = shard.stat().st_size - 1
    _cut(shard, cut_size)
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


@pytest.mark.nemo_rl
def test_without_the_subclass_nemo_rl_resumes_from_the_damaged_one_and_deletes_it(tmp_path, weights):
    """The control: what upstream alone does with the same directory."""
    root = tmp_path / "ckpt"
    for n in (1, 2):
        _write_step(root / f"step_{n}", weights, n)
    _cut(root / "step_2" / STATE_FILE, 7)
    result = _nemo(
        """
manager = CheckpointManager(config)
latest = manager.get_latest_checkpoint_path()
save(manager, 2)
print(json.dumps(dict(latest=latest, after=sorted(p.name for p in root.iterdir()))))
""", root=root, weights=weights)
    assert result["latest"] == str(root / "step_2") and result["after"] == ["step_2"]


@pytest.mark.nemo_rl
def test_nemo_rl_after_a_save_into_a_full_disk(small_disk, weights, tmp_path):
    root = small_disk / "ckpt"
    result = _nemo(
        """
sys.path.insert(0, {repo!r})
from tests.megatron_checkpoint_writer import save_weights
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
