"""`bapo-nemo report` on a real MLflow sqlite store: two runs, one with the embedded trainer's metric names
and one with NeMo-RL v0.7.0's, compared side by side; PNG + HTML written and logged back to both runs."""

from __future__ import annotations

import base64
import re

import matplotlib.image
import pytest
from mlflow.tracking import MlflowClient

from bapo_nemo.cli import main as cli_main
from bapo_nemo.tracking.mlflow_tracker import MlflowTracker

STEPS = 6


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{root}/mlflow.db"
    embedded = MlflowTracker(uri, "bapo-vs-grpo", run_name="bapo-embedded", buffer_dir=root / "buf")
    embedded_id = embedded.start(
        {"loss_fn": {"bapo": {"rho0": 0.4, "order": "paper"}}, "policy": {"optimizer": {"kwargs": {"lr": 0.001}}}}, {}
    )
    for step in range(STEPS):
        embedded.log_metrics({
            "reward/mean": 0.1 * step, "entropy": 1.0 - 0.05 * step, "bapo/rho": 0.3 + 0.01 * step,
            "bapo/rho_initial": 0.25, "bapo/c_low": 0.6 + 0.02 * step, "bapo/c_high": 1.2 + 0.05 * step,
            "grad_norm": 2.0 / (step + 1), "train/response_length_mean": 10.0 + step,
        }, step=step)
        if step % 5 == 0:
            embedded.log_metrics({"eval/avg_at_k": 0.2 + 0.1 * step}, step=step)
    embedded.finish()

    nemo = MlflowTracker(uri, "bapo-vs-grpo", run_name="grpo-nemo", buffer_dir=root / "buf")
    nemo_id = nemo.start({"loss_fn": {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28}}, {})
    for step in range(1, STEPS + 1):  # NeMo-RL logs from step 1
        nemo.log_metrics({"train/reward": 0.05 * step, "train/approx_entropy": 0.9, "train/grad_norm": 1.5,
                          "train/mean_gen_tokens_per_sample": 100.0 + 10 * step}, step=step)
    nemo.log_metrics({"validation/accuracy": 0.35}, step=STEPS)
    nemo.finish()
    MlflowTracker(uri, "other-experiment", buffer_dir=root / "buf").start({}, {})
    return {"uri": uri, "root": root, "embedded": embedded_id, "nemo": nemo_id}


def test_report_two_runs_png_html_and_artifacts(store, tmp_path, capsys):
    out = tmp_path / "report"
    code = cli_main(["report", "--experiment", "bapo-vs-grpo", "--runs", "bapo-embedded", store["nemo"],
                     "--tracking-uri", store["uri"], "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    png, page = out / "training_dynamics.png", out / "report.html"
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 400 and image.shape[1] > 1000  # a 2 x 4 grid of panels
    text = page.read_text()
    embedded_png = re.search(r'src="data:image/png;base64,([^"]+)"', text).group(1)
    assert base64.b64decode(embedded_png) == png.read_bytes()  # self-contained: the same image inline
    assert "bapo-embedded" in text and "grpo-nemo" in text
    # key params and final metrics: embedded reward 0.1 * 5 = 0.5; NeMo-RL reward 0.05 * 6 = 0.3 (via alias)
    assert "<td>0.4</td>" in text and "<td>paper</td>" in text and "<td>0.28</td>" in text
    assert "<td>0.5</td>" in text and "<td>0.3</td>" in text
    # held-out: embedded eval/avg_at_k at step 5 = 0.2 + 0.5 = 0.7; NeMo-RL validation/accuracy 0.35
    assert "<td>0.7</td>" in text and "<td>0.35</td>" in text
    assert "reward/mean &larr; train/reward" in text
    client = MlflowClient(store["uri"])
    for run_id in (store["embedded"], store["nemo"]):
        assert {a.path for a in client.list_artifacts(run_id, "report")} == {"report/training_dynamics.png",
                                                                              "report/report.html"}


def test_aliases_map_both_runtimes(store, tmp_path):
    from bapo_nemo.tracking.report import build_report

    result = build_report(store["uri"], "bapo-vs-grpo", None, tmp_path, log_to_runs=False, progress=False)
    by_name = {r.name: r for r in result.runs}
    assert [r.name for r in result.runs] == ["grpo-nemo", "bapo-embedded"]  # newest first
    nemo, emb = by_name["grpo-nemo"], by_name["bapo-embedded"]
    assert nemo.series["reward/mean"] == [(s, pytest.approx(0.05 * s)) for s in range(1, STEPS + 1)]
    assert nemo.series["response_length/mean"][-1] == (6, 160.0)  # 100 + 10 * 6
    assert nemo.source_names["entropy"] == "train/approx_entropy" and "bapo/rho" not in nemo.series
    assert emb.series["bapo/c_high"][-1] == (5, pytest.approx(1.45))  # 1.2 + 0.05 * 5
    assert emb.series["heldout/avg@k"] == [(0, pytest.approx(0.2)), (5, pytest.approx(0.7))]


def test_unknown_experiment_lists_existing(store, capsys):
    assert cli_main(["report", "--experiment", "nope", "--tracking-uri", store["uri"], "--no-log"]) == 2
    err = capsys.readouterr().err
    assert "no MLflow experiment named 'nope'" in err and "bapo-vs-grpo" in err and "other-experiment" in err


def test_unknown_run_lists_runs(store, capsys):
    code = cli_main(["report", "--experiment", "bapo-vs-grpo", "--runs", "bapo-embedded", "ghost",
                     "--tracking-uri", store["uri"], "--no-log"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no run 'ghost'" in err and f"bapo-embedded ({store['embedded']})" in err and "grpo-nemo" in err


def test_missing_tracking_uri_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli_main(["report", "--experiment", "x"]) == 2
    assert "pass --tracking-uri" in capsys.readouterr().err


def test_missing_database_and_dead_server_are_clear_errors(tmp_path, capsys):
    assert cli_main(["report", "--experiment", "x", "--tracking-uri", f"sqlite:///{tmp_path}/typo.db"]) == 2
    assert f"no MLflow database at {tmp_path}/typo.db" in capsys.readouterr().err
    assert not (tmp_path / "typo.db").exists()  # nothing created at the mistyped path
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli_main(["report", "--experiment", "x", "--tracking-uri", f"http://127.0.0.1:{port}"]) == 2
    assert f"cannot read the MLflow store at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_single_run_plot_is_logged_under_plots(store, tmp_path):
    from bapo_nemo.tracking.report import log_run_plot

    png = log_run_plot(store["uri"], store["embedded"], tmp_path)
    assert matplotlib.image.imread(png).shape[1] > 1000
    paths = {a.path for a in MlflowClient(store["uri"]).list_artifacts(store["embedded"], "plots")}
    assert paths == {"plots/training_dynamics.png"}


def test_rho_panel_target_comes_from_the_runs_that_search(store, tmp_path):
    """The rho panel draws each BAPO run's rho0 (the share the search aims for); runs with BAPO off or
    without BAPO (the NeMo-RL baseline here) add no line."""
    from bapo_nemo.tracking.report import RunData, build_report, target_shares

    result = build_report(store["uri"], "bapo-vs-grpo", None, tmp_path, log_to_runs=False, progress=False)
    assert target_shares(result.runs) == [0.4]  # bapo-embedded: loss_fn.bapo.rho0 = 0.4; grpo-nemo has none
    off = RunData("x", "fixed", "FINISHED", {"loss_fn.bapo.enabled": "False", "loss_fn.bapo.rho0": "0.4"})
    other = RunData("y", "rho05", "FINISHED", {"loss_fn.bapo.enabled": "True", "loss_fn.bapo.rho0": "0.5"})
    assert target_shares([off, other, *result.runs]) == [0.5, 0.4]
