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


def _one_run(store, name: str, steps: dict[int, dict[str, float]]):
    """A run of experiment "figure" in the module's store with the given metrics per step, loaded back as
    the report loads it."""
    from bapo_nemo.tracking.report import load_run

    uri = store["uri"]
    tracker = MlflowTracker(uri, "figure", run_name=name, buffer_dir=store["root"] / "buf")
    run_id = tracker.start({"loss": {"bapo": {"rho0": 0.5}}}, {})
    for step, metrics in steps.items():
        tracker.log_metrics(metrics, step=step)
    tracker.finish()
    client = MlflowClient(uri)
    return load_run(client, client.get_run(run_id))


def test_figure_names_each_series_in_its_panel_and_breaks_undefined_rho(store, tmp_path):
    """rho is undefined in steps 3 and 4 (every group's rewards equal: the trainer logs no rho there) and
    the entropy moves by 1e-5 around 6.1347 (matplotlib's default labels that axis `1e-5+6.1347`). The rho
    line breaks at 3 and 4; each multi-series panel names its series in its own legend; the run is named
    once, in the title; no axis uses an offset."""
    import math

    import matplotlib.pyplot as plt

    from bapo_nemo.tracking.report import CLIP_BOUNDS_NOTE, draw_panels, plot_panels

    steps = {}
    for step in range(1, 7):
        undefined = step in (3, 4)
        steps[step] = {"reward/mean": 0.0 if undefined else 0.5, "frac_reward_zero_std": 1.0 if undefined else 0.25,
                       "entropy": 6.1347 + 1e-5 * (step % 2), "bapo/c_low": 0.6, "bapo/c_high": 1.2 + 0.1 * step,
                       "grad_norm": 0.0 if undefined else 1.0, "train/response_length_mean": 10.0}
        if not undefined:
            steps[step].update({"bapo/rho": 0.48, "bapo/rho_initial": 0.45})
    run = _one_run(store, "zero-spread", steps)
    fig, _ = draw_panels([run])
    fig.canvas.draw()
    axes = {ax.get_title(): ax for ax in fig.axes}
    rho = axes["Positive share rho"]
    chosen, starting = rho.lines[0], rho.lines[1]
    assert list(chosen.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert [math.isnan(y) for y in chosen.get_ydata()] == [False, False, True, True, False, False]
    assert list(starting.get_ydata())[:2] == [0.45, 0.45] and math.isnan(starting.get_ydata()[2])
    legends = {title: [t.get_text() for t in ax.get_legend().get_texts()]
               for title, ax in axes.items() if ax.get_legend()}
    assert legends == {
        "Training reward": ["mean reward", "groups with zero reward spread"],
        "Positive share rho": ["rho at the chosen bounds", "rho at the starting bounds", "target rho0 = 0.5"],
        "Clip bounds": ["c_high", "c_low", CLIP_BOUNDS_NOTE],
    }
    assert "(c_high 1.2 <-> 3.0) are expected" in CLIP_BOUNDS_NOTE
    clip_styles = [h.get_linestyle() for h in axes["Clip bounds"].get_legend().legend_handles]
    assert clip_styles[0] != clip_styles[1]
    assert fig._suptitle.get_text() == f"run {run.label}" and not fig.legends
    for title, ax in axes.items():
        assert ax.yaxis.get_offset_text().get_text() == "", title
    low, high = axes["Policy entropy"].get_ylim()
    assert high - low >= 0.01 * 6.1347 * 0.999  # a flat curve reads as flat
    assert rho.get_ylim() == (-0.03, 1.03)  # a share: its axis is [0, 1]
    plt.close(fig)

    two = [run, _one_run(store, "other", {1: {"reward/mean": 0.2}})]
    fig, _ = draw_panels(two)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [r.label for r in two]
    plt.close(fig)
    plot_panels([run], tmp_path / "zero_spread.png")  # renders


def test_no_empty_panel_a_panel_without_data_is_named_under_the_figure_with_why(store):
    """No step had reward spread, so rho is undefined in every step; entropy and the rest were not logged.
    Only the reward panel is drawn; the others are named, with the reason, in one line under the figure."""
    from bapo_nemo.tracking.report import draw_panels

    run = _one_run(store, "all-zero", {s: {"reward/mean": 0.0, "frac_reward_zero_std": 1.0} for s in (1, 2)})
    fig, panels = draw_panels([run])
    assert [p.title for p in panels] == ["Training reward"]
    assert [ax.get_title() for ax in fig.axes if ax.axison] == ["Training reward"]
    [note] = [t.get_text() for t in fig.texts if t is not fig._suptitle]
    assert note.startswith("not drawn: Held-out avg@k (not logged by these runs); Policy entropy (not logged")
    assert ("Positive share rho (undefined in every step: each group's responses all got the same reward)"
            in note)


def _intervals_run(store, name: str, heldout: dict[int, tuple[float, float]], tokens: tuple[float, float],
                   clipped: tuple[float, float]) -> str:
    """A run of experiment "intervals": held-out avg@4 {step: (value, standard error)} over 64 prompts, and
    rho measured over `tokens` (positive, negative) of which `clipped` (shares) lost their gradient."""
    tracker = MlflowTracker(store["uri"], "intervals", run_name=name, buffer_dir=store["root"] / "buf")
    run_id = tracker.start({"loss_fn": {"bapo": {"rho0": 0.5}}}, {})
    for step in range(1, 5):
        tracker.log_metrics({"reward/mean": 0.5, "bapo/rho": 0.5, "bapo/rho_initial": 0.48,
                             "bapo/tokens_pos": tokens[0], "bapo/tokens_neg": tokens[1],
                             "bapo/clipfrac_pos": clipped[0], "bapo/clipfrac_neg": clipped[1],
                             "bapo/clipfrac_dual": 0.0}, step=step)
    for step, (value, stderr) in heldout.items():
        tracker.log_metrics({"eval/avg_at_k": value, "eval/avg_at_k_stderr": stderr, "eval/num_prompts": 64,
                             "eval/samples_per_prompt": 4}, step=step)
    tracker.finish()
    return run_id


def test_held_out_points_carry_their_sample_and_interval_and_rho_says_what_it_counts(store, tmp_path):
    """Two one-seed runs whose held-out avg@4 spans 0.51-0.61 over 64 prompts x 4 samples (standard errors
    0.03 and 0.031 over prompts): each point gets its 95% interval (1.96 standard errors either side), the
    panel names the sample, and the axis spans [0, 1], so a 0.01 difference is not drawn as a gap. Their rho
    is measured over different tokens (BAPO 600 x 0.9 + 500 x 0.8 = 940 with gradient per update, fixed
    clip 200 x 0.7 + 150 x 0.8 = 260): the rho panel names each count and says the sets differ. The report
    command prints the same in words."""
    from mlflow.tracking import MlflowClient

    from bapo_nemo.tracking.report import draw_panels, load_run
    from tests.support import cli_process
    from tests.support.hang_guard import HANG_GUARD_S

    bapo = _intervals_run(store, "bapo", {0: (0.51, 0.03), 4: (0.61, 0.03)}, (600, 500), (0.1, 0.2))
    fixed = _intervals_run(store, "fixed", {0: (0.51, 0.031), 4: (0.60, 0.031)}, (200, 150), (0.3, 0.2))
    client = MlflowClient(store["uri"])
    runs = [load_run(client, client.get_run(run_id)) for run_id in (bapo, fixed)]
    fig, _ = draw_panels(runs)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.axison}
    heldout = axes["Held-out avg@k (64 prompts x 4 samples)"]
    assert heldout.get_ylim() == (-0.03, 1.03)
    bars = [segment for collection in heldout.collections for segment in collection.get_segments()]
    assert sorted((round(s[0][0]), round(s[0][1], 4), round(s[1][1], 4)) for s in bars) == [
        (0, 0.4492, 0.5708), (0, 0.4512, 0.5688), (4, 0.5392, 0.6608), (4, 0.5512, 0.6688)]
    legend = [t.get_text() for t in heldout.get_legend().get_texts()]
    assert legend == ["bars: 95% interval over prompts"]
    rho = [t.get_text() for t in axes["Positive share rho"].get_legend().get_texts()]
    assert rho[-3:] == ["bapo: over ~940 tokens with gradient per update",
                        "fixed: over ~260 tokens with gradient per update", "shares over different token sets"]
    assert axes["Positive share rho"].get_ylim() == (-0.03, 1.03)

    done = cli_process.run("report", "--experiment", "intervals", "--tracking-uri", store["uri"], "--no-log",
                           "--out", str(tmp_path / "report"), cwd=tmp_path, env=cli_process.cli_env(),
                           timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    label = {run.name: run.label for run in runs}
    assert lines[1] == "held-out avg@k, 95% interval over prompts (64 prompts x 4 samples):"
    assert lines[2].split() == [*label["fixed"].split(), "0.510", "[0.449,", "0.571]", "at", "step", "0", "->",
                                "0.600", "[0.539,", "0.661]", "at", "step", "4", "(+0.090)"]
    assert lines[3].split() == [*label["bapo"].split(), "0.510", "[0.451,", "0.569]", "at", "step", "0", "->",
                                "0.610", "[0.551,", "0.669]", "at", "step", "4", "(+0.100)"]
    assert lines[4] == ("  a difference under about 0.060 (the typical interval's half-width) is within the noise of "
                        "this held-out set")
    assert lines[5] == ("rho = P / (P + N) is measured over each run's own tokens; tokens per update (median): "
                        f"{label['fixed']} 260 tokens, {label['bapo']} 940 tokens")
    assert "different token sets" in lines[6]
    assert "In numbers" in (tmp_path / "report" / "report.html").read_text()
