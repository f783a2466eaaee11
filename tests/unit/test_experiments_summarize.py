"""The summary step on a small hand-made MLflow sqlite store (real mlflow): per-run statistics, mean +- std
over seeds, incomplete runs left out and named, the generated doc block and figure."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.grid import Budget, Cell, Study, expand
from experiments.report import update_doc
from experiments.run import experiment_name, tracking_uri
from experiments.study_summary import mean_std, run_stats, summarize_study
from experiments.summarize import write_outputs

# 10 RL steps: the final window W is round(0.2 * 10) = 2 steps, so "start" = steps 1-2, "end" = steps 9-10.
BUDGET = Budget(max_steps=10, eval_every=5, seeds=(0, 1))
TOY = Study(
    "toy",
    "Two arms of a toy study.",
    (Cell({"arm": "a"}, {"loss_fn.bapo.rho0": 0.3}), Cell({"arm": "b"}, {"loss_fn.bapo.rho0": 0.5})),
)
STEPS = range(1, 11)


def _const(v):
    return {s: v for s in STEPS}


# Hand-made histories (metric -> step -> value).
A0 = {  # arm a, seed 0
    "eval/avg_at_k": {0: 0.5, 5: 0.55, 10: 0.6},
    "reward/mean": {s: 0.1 * s for s in STEPS},  # end: (0.9 + 1.0) / 2 = 0.95
    "entropy": {s: 0.8 if s <= 8 else 0.4 for s in STEPS},  # start 0.8, end 0.4 (not < 0.25 * 0.8)
    "bapo/c_low": _const(0.6),
    "bapo/c_high": {s: 1.2 if s <= 5 else 1.5 for s in STEPS},  # mean (5 * 1.2 + 5 * 1.5) / 10 = 1.35
    "bapo/rho": _const(0.4),
    "bapo/target_met": {s: float(s % 2 == 0) for s in STEPS},  # 5 of 10 = 0.5
    "grad_norm": _const(1.0),
}
A1 = {  # arm a, seed 1: held-out accuracy falls 0.5 -> 0.2 < 0.5 * 0.5: collapsed
    "eval/avg_at_k": {0: 0.5, 5: 0.3, 10: 0.2},
    "reward/mean": _const(0.5),
    "entropy": _const(0.6),
    "bapo/c_low": _const(0.7),
    "bapo/c_high": _const(1.25),
    "bapo/rho": _const(0.3),
    "bapo/target_met": _const(0.0),
    "grad_norm": _const(3.0),
}
B0 = {  # arm b, seed 0: entropy 1.0 -> 0.2 < 0.25 * 1.0: collapsed
    "eval/avg_at_k": {0: 0.4, 5: 0.4, 10: 0.4},
    "reward/mean": _const(0.25),
    "entropy": {s: 1.0 if s <= 2 else 0.2 for s in STEPS},
    "bapo/c_low": _const(0.9),
    "bapo/c_high": _const(3.0),
    "bapo/rho": _const(0.2),
    "bapo/target_met": _const(0.0),
    "grad_norm": _const(2.0),
}
B1_UNFINISHED = {"eval/avg_at_k": {0: 0.4}, "reward/mean": {1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1}}


def _log(client, experiment_id, name, history, finished=True):
    from mlflow.entities import Metric

    run = client.create_run(experiment_id, run_name=name)
    metrics = [
        Metric(k, v, 1_000 + step, step) for k, series in history.items() for step, v in series.items()
    ]
    for i in range(0, len(metrics), 900):
        client.log_batch(run.info.run_id, metrics=metrics[i : i + 900])
    if finished:
        client.set_terminated(run.info.run_id, "FINISHED")


@pytest.fixture
def toy_store(tmp_path):
    from mlflow.tracking import MlflowClient

    root = tmp_path / "runs"
    (root / "full" / "toy").mkdir(parents=True)
    client = MlflowClient(tracking_uri=tracking_uri(root, "full", "toy"))
    exp = client.create_experiment(
        experiment_name("toy", "full"), artifact_location=(tmp_path / "artifacts").as_uri()
    )
    specs = {(r.cell.labels["arm"], r.seed): r for r in expand(TOY, "full", BUDGET)}
    _log(client, exp, specs[("a", 0)].run_name, A0)
    _log(client, exp, specs[("a", 1)].run_name, A1)
    _log(client, exp, specs[("b", 0)].run_name, B0)
    _log(client, exp, specs[("b", 1)].run_name, B1_UNFINISHED, finished=False)  # killed at step 4
    _log(client, exp, "some-other-run", A0)  # not part of the study: ignored
    return root


def test_run_stats_hand_computed():
    s = run_stats(A0, 10)
    assert s["heldout_start"] == 0.5 and s["heldout_end"] == 0.6
    assert s["heldout_gain"] == pytest.approx(0.1)
    assert s["reward_end"] == pytest.approx(0.95)
    assert (s["entropy_start"], s["entropy_end"]) == (pytest.approx(0.8), pytest.approx(0.4))
    assert s["collapsed"] == 0.0
    assert s["c_high"] == pytest.approx(1.35) and s["c_low"] == pytest.approx(0.6)
    assert s["target_met"] == pytest.approx(0.5)
    assert run_stats(A1, 10)["collapsed"] == 1.0  # reward collapse
    assert run_stats(B0, 10)["collapsed"] == 1.0  # entropy collapse


def test_mean_std_arithmetic():
    # mean 2, sample variance ((1-2)^2 + 0 + (3-2)^2) / 2 = 1
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0, 3)
    mean, std, n = mean_std([5.0, math.nan])
    assert (mean, n) == (5.0, 1) and math.isnan(std)  # one value: no spread


def test_summary_from_mlflow_store(toy_store, tmp_path):
    summary = summarize_study(TOY, "full", toy_store, BUDGET)
    assert len(summary.records) == 4
    assert sorted((r.spec.cell.labels["arm"], r.spec.seed) for r in summary.completed) == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
    ]
    (missing,) = summary.missing
    assert (missing.spec.cell.labels["arm"], missing.spec.seed) == ("b", 1)
    assert "last logged step 4 of 10" in missing.reason

    a = summary.cells["arm=a"]
    # held-out end: seeds 0.6 and 0.2 -> mean 0.4, sample std |0.6 - 0.2| / sqrt(2) = 0.28284
    assert a["heldout_end"][0] == pytest.approx(0.4)
    assert a["heldout_end"][1] == pytest.approx(0.4 / math.sqrt(2))
    # paired gain: +0.1 and -0.3 -> mean -0.1, std 0.4 / sqrt(2)
    assert a["heldout_gain"][:2] == (pytest.approx(-0.1), pytest.approx(0.4 / math.sqrt(2)))
    # final reward: 0.95 and 0.5 -> mean 0.725, std 0.45 / sqrt(2) = 0.31820
    assert a["reward_end"][:2] == (pytest.approx(0.725), pytest.approx(0.45 / math.sqrt(2)))
    # c_high: 1.35 and 1.25 -> 1.3 +- 0.1 / sqrt(2); grad norm 1 and 3 -> 2 +- sqrt(2)
    assert a["c_high"][:2] == (pytest.approx(1.3), pytest.approx(0.1 / math.sqrt(2)))
    assert a["grad_norm"][:2] == (pytest.approx(2.0), pytest.approx(math.sqrt(2)))
    # target met 0.5 and 0 -> 0.25; one of two seeds collapsed -> 0.5
    assert a["target_met"][0] == pytest.approx(0.25) and a["collapsed"][0] == 0.5
    b = summary.cells["arm=b"]
    assert (
        b["heldout_end"][2] == 1
        and b["heldout_end"][0] == pytest.approx(0.4)
        and math.isnan(b["heldout_end"][1])
    )

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("# Results\n\nHand-written analysis stays.\n")
    figure, table = write_outputs(summary, docs)
    assert figure.stat().st_size > 10_000 and figure.read_bytes()[:4] == b"\x89PNG"
    assert (figure.parent / "toy_final.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads(table.read_text())
    assert data["cells"]["arm=a"]["reward_end"]["mean"] == pytest.approx(0.725)
    assert list(data["not_completed"]) == [missing.spec.run_name]
    text = (docs / "results.md").read_text()
    assert "Hand-written analysis stays." in text
    assert "**Completed runs: 3 of 4.**" in text
    assert "| arm=a | 2 | 0.500 ± 0.000 → 0.400 ± 0.283 | -0.100 ± 0.283 | 0.725 ± 0.318 |" in text
    assert "`arm=b` seed 1 (running, last logged step 4 of 10)" in text


def test_update_doc_replaces_only_its_block(tmp_path):
    doc = tmp_path / "results.md"
    doc.write_text("intro\n")
    update_doc(doc, "full/x", "first\n")
    update_doc(doc, "full/y", "other\n")
    update_doc(doc, "full/x", "second\n")
    text = doc.read_text()
    assert text.startswith("intro\n") and "first" not in text
    assert text.count("second") == 1 and text.count("other") == 1
    assert text.index("second") < text.index("other")  # replaced in place


def test_t_interval_hand_computed():
    from experiments.study_summary import t_interval

    # mean 2, sample std 1, n 3: half-width t_{0.975, 2} * 1 / sqrt(3) = 4.303 / 1.732 = 2.4843
    mean, low, high, n = t_interval([1.0, 2.0, 3.0])
    assert (
        (mean, n) == (2.0, 3)
        and low == pytest.approx(2 - 2.4843, abs=1e-3)
        and high == pytest.approx(2 + 2.4843, abs=1e-3)
    )
    assert math.isnan(t_interval([1.0])[1]) and t_interval([])[3] == 0
    scipy_stats = pytest.importorskip("scipy.stats")  # independent check of the quantile table
    from experiments.study_summary import _T975

    assert [round(float(scipy_stats.t.ppf(0.975, df)), 3) for df in range(1, 31)] == list(_T975)


PAIRED = Study(
    "pairs",
    "fixed vs bapo at two staleness levels.",
    tuple(
        Cell(
            {"updates": u, "method": m}, {"train.updates_per_batch": int(u), "loss_fn.bapo.enabled": m == "bapo"}
        )
        for u in ("1", "4")
        for m in ("fixed", "bapo")
    ),
    row_axis="updates",
    paired_against="fixed",
)
PAIRED_BUDGET = Budget(max_steps=10, eval_every=5, seeds=(0, 1, 2))


def _pair_history(start, end, entropy, pos, neg, right, wrong):
    return {
        "eval/avg_at_k": {0: start, 10: end},
        "reward/mean": _const(0.5),
        "entropy": _const(entropy),
        "bapo/positive_mass": _const(pos),
        "bapo/negative_mass": _const(neg),
        "train/response_length_correct": _const(right),
        "train/response_length_wrong": _const(wrong),
    }


def test_paired_differences_and_signature_from_mlflow_store(tmp_path):
    """Gains (end - start) per seed: fixed at 4 updates 0.0 / -0.1 / -0.2, bapo at 4 updates +0.1 / 0.0 / -0.1:
    paired differences +0.1 each, so mean +0.1 and a zero-width interval; at 1 update bapo - fixed =
    +0.2, -0.2, 0 -> mean 0, half-width 4.303 * 0.2 / sqrt(3) = 0.4969."""
    from mlflow.tracking import MlflowClient

    from experiments.study_summary import paired_differences

    root = tmp_path / "runs"
    (root / "full" / "pairs").mkdir(parents=True)
    client = MlflowClient(tracking_uri=tracking_uri(root, "full", "pairs"))
    exp = client.create_experiment(
        experiment_name("pairs", "full"), artifact_location=(tmp_path / "a").as_uri()
    )
    gains = {
        ("1", "fixed"): (0.1, 0.1, 0.1),
        ("1", "bapo"): (0.3, -0.1, 0.1),
        ("4", "fixed"): (0.0, -0.1, -0.2),
        ("4", "bapo"): (0.1, 0.0, -0.1),
    }
    for spec in expand(PAIRED, "full", PAIRED_BUDGET):
        key = (spec.cell.labels["updates"], spec.cell.labels["method"])
        gain = gains[key][spec.seed]
        # fixed clip: P = 1, N = 3 (share 0.25), wrong answers 30 tokens vs 10 right
        _log(client, exp, spec.run_name, _pair_history(0.4, 0.4 + gain, 0.5, 1.0, 3.0, 10.0, 30.0))
    summary = summarize_study(PAIRED, "full", root, PAIRED_BUDGET)
    diffs = {(d.cell, d.key): d for d in paired_differences(summary)}
    assert set(diffs) == {
        (c, k)
        for c in ("updates=1/method=bapo", "updates=4/method=bapo")
        for k in ("heldout_gain", "entropy_end", "reward_end")
    }
    d4 = diffs[("updates=4/method=bapo", "heldout_gain")]
    assert d4.baseline == "updates=4/method=fixed" and d4.n == 3
    assert (d4.mean, d4.low, d4.high) == (pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.1))
    d1 = diffs[("updates=1/method=bapo", "heldout_gain")]
    assert d1.mean == pytest.approx(0.0, abs=1e-12)
    assert (d1.low, d1.high) == (pytest.approx(-0.4969, abs=1e-3), pytest.approx(0.4969, abs=1e-3))
    fixed = summary.cells["updates=4/method=fixed"]
    assert fixed["share"][0] == pytest.approx(0.25) and fixed["length_wrong_over_correct"][
        0
    ] == pytest.approx(3.0)

    docs = tmp_path / "docs"
    docs.mkdir()
    write_outputs(summary, docs)
    out = docs / "results" / "full"
    assert (out / "pairs_signature.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "pairs_paired.png").read_bytes()[:4] == b"\x89PNG"
    text = (docs / "results.md").read_text()
    assert "| updates=4/method=fixed | 3 | 0.250 ± 0.000 | 3.00 ± 0.00 |" in text
    assert "| updates=4/method=bapo | 3 | +0.100 [+0.100, +0.100] |" in text
    data = json.loads((out / "pairs.json").read_text())
    assert {d["cell"] for d in data["paired_differences"]} == {
        "updates=1/method=bapo",
        "updates=4/method=bapo",
    }
