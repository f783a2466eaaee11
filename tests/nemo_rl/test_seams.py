"""No silent seams: for every place the adapter touches NeMo-RL (bapo_nemo/nemo/seams.py), a NeMo-RL whose
call site moved makes the driver refuse before anything starts, with one line naming the installed NeMo-RL,
the hook and the tested versions. The trees are copies of the NeMo-RL under test (NEMO_RL_SRC) with one
function changed each (tests/support/nemo_seam_cases.py); the unchanged tree is the control."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_nemo.nemo.seams import SEAMS
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.nemo_seam_cases import CASES, SYNC

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case's driver run, in one subprocess (NeMo-RL is re-imported from each copy there)."""
    root = tmp_path_factory.mktemp("seams")
    out = root / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.nemo_seam_cases", str(out), str(root)],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {"root": root, **json.loads(out.read_text())}


def _has_early_stop_helper() -> bool:
    from nemo_rl.algorithms import grpo

    return hasattr(grpo, "_validation_early_stop_message")


def test_every_seam_has_a_case():
    """A seam added to the table without a moved-call-site case here would go untested."""
    assert {s.target.split(":")[1] for s in SEAMS} == {case.seam for case in CASES.values()}


def test_the_unchanged_tree_places_every_hook(results):
    assert results["unchanged"] == []
    assert results["unchanged, in-flight updates"] == []
    if _has_early_stop_helper():
        assert results["unchanged, async"] == []
    else:  # v0.7.0: no validation early stop at all; a config asking for it is refused, naming why
        (line,) = results["unchanged, async"]
        assert "_validation_early_stop_message does not exist" in line
        assert "Turn grpo.stop_at_validation_metric off" in line


@pytest.mark.parametrize("label", sorted(k for k, c in CASES.items() if c.refuses))
def test_a_moved_call_site_makes_the_driver_refuse_before_anything_starts(results, label):
    case, run = CASES[label], results[label]
    if not run["applied"]:  # the site is absent from this NeMo-RL: the unchanged tree must refuse already
        assert not _has_early_stop_helper() and case.seam == "_validation_early_stop_message", label
    assert run["rc"] == 2, run["stdout"][-2000:] + run["stderr"][-2000:]
    # one line per seam off the call path (a moved policy.train takes the loss's seam with it)
    lines = run["stderr"].strip().removeprefix("error: ").splitlines()
    assert run["stderr"].startswith("error: NeMo-RL ") and all(x.startswith("NeMo-RL ") for x in lines)
    for line in lines:
        assert f"({run['nemo_rl'].rsplit('/', 1)[0]})" in line  # the installed NeMo-RL, where it is imported from
        assert "cannot place the hook on nemo_rl." in line
        assert "a tested NeMo-RL: v0.7.0" in line and "main of 2026-08-22" in line
    assert len([x for x in lines if f".{case.seam} (" in x]) == 1
    assert run["written"] == [] and run["ray_started"] is False


def test_the_command_refuses_as_a_user_runs_it(results, tmp_path):
    """`python -m bapo_nemo.train` in a fresh process on one moved tree: exit 2, one line, nothing written."""
    label = next(k for k, c in sorted(CASES.items()) if c.refuses and list(c.run) == SYNC and results[k]["applied"])
    tree = Path(results[label]["tree"])
    env = {**os.environ, "NEMO_RL_SRC": str(tree), "PYTHONPATH": os.pathsep.join([str(tree), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "bapo_nemo.train", *SYNC, "--skip-checks", f"logger.log_dir={tmp_path}/logs",
         f"checkpointing.checkpoint_dir={tmp_path}/ckpt"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "cannot place the hook on" in line and str(tree) in line
    assert not (tmp_path / "logs").exists() and not (tmp_path / "ckpt").exists()


def test_a_probe_off_the_call_path_keeps_the_packing_guard_on_and_says_so(results):
    """The one seam with a fallback: the probe of `_pack_input_ids` decides whether the FP8 packing-width
    guard is needed (main's fix, #3182). With the loss input packing through another helper, the probe's
    answer may not be the path's: the run goes on with the guard on (correct either way), and says why."""
    run = results["the packed loss input packs through another helper"]
    assert run["applied"]
    assert run["off_path"] == ["nemo_rl.algorithms.loss.utils:_pack_input_ids"]
    assert run["guard"] is True
    (line,) = run["stderr"].strip().splitlines()
    assert line.startswith("warning: NeMo-RL ") and "the packing-width guard stays on" in line
    assert "prepare_packed_loss_input no longer calls _pack_input_ids(...) as a module global" in line


def test_worker_groups_off_the_call_path_leave_the_run_without_its_worker_watch_and_say_so(results):
    """The worker watch (nemo/worker_watch.py) reads the policy's `worker_group`: where Policy.train no
    longer goes through it, the watch would watch other workers than the ones training. The run goes on
    without it (a lost worker is then seen when Ray or a collective times out), with a warning naming why."""
    run = results["Policy trains through another worker group attribute"]
    assert run["applied"]
    assert run["off_path"] == ["nemo_rl.distributed.worker_groups:RayWorkerGroup.workers"]
    (line,) = run["stderr"].strip().splitlines()
    assert line.startswith("warning: NeMo-RL ") and "no watch: a lost worker is seen when Ray" in line
    assert "Policy.train no longer reads self.worker_group.run_all_workers_sharded_data" in line
