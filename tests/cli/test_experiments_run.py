"""The runner's skip / resume / move-aside logic (no training: run directories are made by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.grid import Budget, expand
from experiments.run import DONE, SPEC, main, move_aside, plan, run_dir, run_status, run_studies, warmup_dir


def _make(path: Path, fingerprint: str, done: bool) -> None:
    path.mkdir(parents=True)
    (path / SPEC).write_text(json.dumps({"fingerprint": fingerprint}))
    (path / "metrics.jsonl").write_text('{"step": 0}\n')
    if done:
        (path / DONE).write_text(json.dumps({"fingerprint": fingerprint, "seconds": 1.0}))


def test_run_status(tmp_path):
    assert run_status(tmp_path / "absent", "abc") == "new"
    _make(tmp_path / "started", "abc", done=False)
    assert run_status(tmp_path / "started", "abc") == "resume"
    _make(tmp_path / "finished", "abc", done=True)
    assert run_status(tmp_path / "finished", "abc") == "done"
    # same directory, other settings (e.g. the grid was edited): neither skipped nor resumed
    assert run_status(tmp_path / "finished", "xyz") == "conflict"
    (tmp_path / "no_spec").mkdir()
    assert run_status(tmp_path / "no_spec", "abc") == "conflict"


def test_plan_marks_done_resume_and_new(tmp_path):
    specs = expand("measure", "quick")  # 2 arms x 2 seeds, seed-major
    _make(run_dir(tmp_path, specs[0]), specs[0].fingerprint, done=True)
    _make(run_dir(tmp_path, specs[1]), specs[1].fingerprint, done=False)
    _, status = plan(["measure"], "quick", tmp_path)
    assert [status[s.run_name] for s in specs] == ["done", "resume", "new", "new"]


def test_completed_study_is_skipped_without_starting_anything(tmp_path, capsys):
    specs = expand("rho0", "quick")
    for s in specs:
        _make(run_dir(tmp_path, s), s.fingerprint, done=True)
    counts = run_studies(["rho0"], "quick", jobs=2, root=tmp_path, progress=False)
    assert counts == {"done": 0, "skipped": len(specs), "failed": 0, "stopped": 0}
    assert not (tmp_path / "quick" / "rho0" / "mlflow.db").exists()  # nothing was started
    assert not (tmp_path / "_warmup").exists()
    assert main(["rho0", "--quick", "--root", str(tmp_path)]) == 0
    assert "already done" in capsys.readouterr().err


def test_move_aside_keeps_the_old_directory(tmp_path):
    path = tmp_path / "run"
    _make(path, "old", done=True)
    moved = move_aside(path)
    assert not path.exists()
    assert moved.parent == tmp_path and moved.name.startswith("run.superseded-")
    assert json.loads((moved / DONE).read_text())["fingerprint"] == "old"


def test_dry_run_lists_every_run(tmp_path, capsys):
    assert main(["staleness", "--dry-run", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 36 and all(line.startswith("new") for line in out)
    assert "train.updates_per_batch=8" in next(line for line in out if "updates-8__method-bapo" in line)


def test_warmup_is_shared_by_modes_not_by_seeds_or_settings(tmp_path):
    # quick and full warm up identically (same seed, same base config): one warm-up serves both
    assert warmup_dir(tmp_path, "quick", 0) == warmup_dir(tmp_path, "full", 0)
    assert warmup_dir(tmp_path, "full", 0) != warmup_dir(tmp_path, "full", 1)
    shorter = Budget(3, 1, (0,), extra=(("warmup.steps", 20),))
    assert warmup_dir(tmp_path, "full", 0, shorter) != warmup_dir(tmp_path, "full", 0)


def test_export_commit_is_a_clean_copy_of_that_commit(tmp_path):
    import subprocess

    from experiments.run import REPO, export_commit

    code_dir, sha = export_commit(tmp_path, "HEAD")
    assert code_dir == tmp_path / "_code" / sha and len(sha) == 40
    committed = subprocess.run(
        ["git", "show", f"{sha}:experiments/base.yaml"], cwd=REPO, capture_output=True, check=True
    ).stdout
    assert (code_dir / "experiments" / "base.yaml").read_bytes() == committed
    assert (code_dir / "bapo_nemo" / "algorithm" / "bapo.py").is_file()
    assert export_commit(tmp_path, sha) == (code_dir, sha)  # made once, then reused


def test_warmup_cache_is_copied_once_and_never_overwritten(tmp_path):
    from experiments.worker import seed_warmup_cache

    source = tmp_path / "warm"
    (source / "warmup" / "model").mkdir(parents=True)
    (source / "warmup" / "info.json").write_text('{"key": 1}')
    (source / "warmup" / "model" / "model.safetensors").write_bytes(b"weights")
    run = tmp_path / "run"
    run.mkdir()
    seed_warmup_cache(source, run)
    assert (run / "warmup" / "model" / "model.safetensors").read_bytes() == b"weights"
    assert not (run / "warmup.copying").exists()
    # a run that already has a cache (e.g. a resumed one) keeps its own
    (run / "warmup" / "info.json").write_text('{"key": 2}')
    seed_warmup_cache(source, run)
    assert (run / "warmup" / "info.json").read_text() == '{"key": 2}'
    # no usable source (no info.json): nothing is copied
    other = tmp_path / "other"
    other.mkdir()
    seed_warmup_cache(tmp_path / "missing", other)
    assert not (other / "warmup").exists()
