"""Damaged checkpoints and a full disk (bapo_nemo/nemo/checkpoint_integrity.py) on real megatron-core
dist_checkpointing saves (torch_dist, 2 gloo ranks on CPU: tests/support/checkpoints.py) and a real small
tmpfs for the full disk (with NeMo-RL's own CheckpointManager: tests/nemo_rl/test_checkpoint_integrity.py)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from bapo_nemo.nemo.checkpoint_integrity import damage, disk_full_line, newest_intact, no_space_left
from bapo_nemo.nemo.partial_rollout import STATE_FILE
from tests.support.checkpoints import WEIGHTS, largest_shard, truncate, write_step

pytest.importorskip("megatron.core", reason="megatron-core (the nemo-cpu extra) writes the checkpoints here")


@pytest.fixture
def step(tmp_path, weights) -> Path:
    step_dir = tmp_path / "ckpt" / "step_1"
    write_step(step_dir, weights, 1)
    return step_dir


def test_a_real_megatron_checkpoint_is_intact(step):
    files = {p.name for p in (step / WEIGHTS).iterdir()}
    assert {".metadata", "metadata.json"} <= files and len([f for f in files if f.endswith(".distcp")]) >= 2
    assert damage(step) is None


@pytest.mark.parametrize("cut", ["one byte", "half"])
def test_a_truncated_shard_is_named_with_the_bytes_its_items_need(step, cut):
    shard = largest_shard(step)
    size = shard.stat().st_size  # torch DCP writes a shard's items back to back: the last one ends the file
    truncate(shard, size - 1 if cut == "one byte" else size // 2)
    expected = f"{WEIGHTS / shard.name} is truncated ({shard.stat().st_size} bytes, its items need {size})"
    assert damage(step) == expected


def test_a_missing_shard_and_an_unfinalised_save_are_named(step):
    shard = largest_shard(step)
    shard.unlink()
    assert damage(step) == f"{WEIGHTS / shard.name} is missing"
    (step / WEIGHTS / ".metadata").unlink()  # what a save stopped before its coordinator finished leaves
    assert damage(step) == f"{WEIGHTS / '.metadata'} is missing (the distributed checkpoint was never finalised)"


def test_cut_metadata_is_named(step):
    metadata = step / WEIGHTS / ".metadata"
    truncate(metadata, metadata.stat().st_size // 2)
    assert damage(step).startswith(f"{WEIGHTS / '.metadata'} does not read (")
    (step / WEIGHTS / "metadata.json").unlink()
    assert damage(step).startswith(f"{WEIGHTS / '.metadata'} does not read (")  # the first problem found


def test_megatron_format_marker_missing_is_named(step):
    (step / WEIGHTS / "metadata.json").unlink()
    assert damage(step) == f"{WEIGHTS / 'metadata.json'} is missing"


@pytest.mark.parametrize("name", [STATE_FILE, "training_info.json"])
def test_a_cut_json_file_is_named(step, name):
    path = step / name
    truncate(path, path.stat().st_size - 1)
    assert damage(step).startswith(f"{name} does not parse as JSON (")


def test_missing_training_info_and_a_cut_torch_save_file_are_named(step):
    loader = step / "train_dataloader.pt"
    truncate(loader, loader.stat().st_size - 1)
    assert damage(step).startswith("train_dataloader.pt is not a complete torch.save archive (")
    (step / "training_info.json").unlink()
    assert damage(step) == "training_info.json is missing"


def test_newest_intact_skips_damaged_newer_ones(tmp_path, weights):
    root = tmp_path / "ckpt"
    for n in (1, 2, 3, 10):
        write_step(root / f"step_{n}", weights, n)
    (root / "tmp_step_11").mkdir()  # an unfinished save is never a candidate
    shard = largest_shard(root / "step_10")
    truncate(shard, 10)
    truncate(root / "step_3" / STATE_FILE, 5)
    intact, damaged = newest_intact(root)
    assert intact == root / "step_2"
    assert [(p.name, r.split(" ")[0]) for p, r in damaged] == [
        ("step_10", str(WEIGHTS / shard.name)), ("step_3", STATE_FILE)]
    for n in (1, 2):
        truncate(root / f"step_{n}" / "training_info.json", 3)
    assert newest_intact(root)[0] is None and len(newest_intact(root)[1]) == 4


# ---- a full disk: a real tmpfs -------------------------------------------------------------------------


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
    from tests.support.megatron_checkpoint_writer import save_weights

    root = small_disk / "ckpt"
    write_step(root / "step_1", weights, 1)
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


