"""How many responses one BAPO bound search sees (`bapo_nemo.plan.simulation.search_stats`) and the warning
`bapo-nemo check` gives: the packing and sharding rule on hand-computed cases, the sign statistics
against a closed form, and the shipped configs' verdicts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bapo_nemo.cli import main as cli_main
from bapo_nemo.plan.check_cli import configure_parser, run_check
from bapo_nemo.plan.simulation.search_stats import (
    LengthModel,
    LengthModelError,
    SearchShape,
    first_fit_decreasing,
    read_lengths,
    searches_of_global_batch,
    simulate,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _args(config, nodes, *extra):
    """Overrides (key=value) go right after the config; options (--x v) after the cluster shape."""
    overrides = [x for x in extra if "=" in x and not x.startswith("--")]
    options = [x for x in extra if x not in overrides]
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(
        [str(config), *overrides, "--nodes", str(nodes), "--gpus-per-node", "8", *options]
    )


def test_first_fit_decreasing_by_hand():
    # 30 opens bin 0 (room 10); 20 opens bin 1 (room 20); 20 fills bin 1; 10 fills bin 0.
    assert first_fit_decreasing([30, 20, 20, 10], 40, min_bins=1, multiple=1) == [[0, 3], [1, 2]]
    # An odd bin count is padded with an empty bin for DP 2 (every rank runs the same micro-batches).
    assert first_fit_decreasing([30, 30, 30], 40, min_bins=2, multiple=2) == [[0], [1], [2], []]
    with pytest.raises(LengthModelError, match="train_mb_tokens"):
        first_fit_decreasing([50], 40, 1, 1)


def test_a_search_reduces_over_one_bin_per_dp_rank():
    shape = SearchShape(
        global_batch=8, group_size=4, dp=2, bin_tokens=100, micro_batch_size=1, prompt_tokens=0
    )
    # lengths 50, 50 fill one bin each; 30, 30, 30 share a bin; 60, 40 pair; 20 is left: bins
    # [0,1]=50+50? no: FFD sorted 60(6),50(0),50(1),40(7),30(2),30(3),30(4),20(5):
    # bin0: 60+40(7)=100; bin1: 50+50=100; bin2: 30+30+30=90; bin3: 20 -> 4 bins, searches (0,1), (2,3).
    lengths = [50, 50, 30, 30, 30, 20, 60, 40]
    assert searches_of_global_batch(lengths, shape) == [[6, 7, 0, 1], [2, 3, 4, 5]]
    step = SearchShape(
        global_batch=8, group_size=4, dp=2, bin_tokens=100, micro_batch_size=1, granularity="step"
    )
    assert searches_of_global_batch(lengths, step) == [list(range(8))]
    fixed = SearchShape(global_batch=8, group_size=4, dp=2, bin_tokens=None, micro_batch_size=2)
    # No packing: rank 0 holds rows 0-3, rank 1 rows 4-7; micro-batch j of both ranks is one search.
    assert searches_of_global_batch(lengths, fixed) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_constant_lengths_give_bin_over_sequence_responses_per_search():
    # 8,000 + 150 prompt tokens, rounded up to 64 -> 8,192: 4 per 34,816-token bin, x DP 2 = 8.
    shape = SearchShape(
        global_batch=256, group_size=16, dp=2, bin_tokens=34816, micro_batch_size=1, pad_multiple=64
    )
    stats = simulate(shape, LengthModel(max_tokens=32768, median=8000, sigma=0.0), global_batches=5)
    assert stats.responses_p10 == stats.responses_p90 == 8
    assert stats.searches == 5 * 256 // 8


def test_one_sided_share_matches_the_closed_form():
    """Bins of exactly two responses of one group (constant lengths keep the group order). With pass
    rate p ~ U(0,1) a pair sees both signs iff its rewards differ: P = E[2p(1-p)] = 1/3, so 2/3 of
    the searches are one-sided."""
    shape = SearchShape(
        global_batch=256, group_size=16, dp=1, bin_tokens=2 * 1024, micro_batch_size=1, prompt_tokens=24
    )
    stats = simulate(shape, LengthModel(max_tokens=4000, median=1000, sigma=0.0), global_batches=100)
    assert stats.responses_median == 2 and stats.groups_mean == 1
    assert stats.one_sided == pytest.approx(2 / 3, abs=0.02)


def test_truncated_responses_score_zero():
    # Every response hits the cap: every group is all-wrong, no search has any signal.
    shape = SearchShape(
        global_batch=64, group_size=16, dp=1, bin_tokens=8192, micro_batch_size=1, prompt_tokens=0
    )
    stats = simulate(shape, LengthModel(max_tokens=1000, median=5000, sigma=0.0), global_batches=3)
    assert stats.no_signal == 1.0 and stats.one_sided == 1.0


@pytest.mark.parametrize("name,nodes", [("bapo_7b.yaml", 1), ("bapo_32b.yaml", 8), ("bapo_32b_64k.yaml", 8)])
def test_microbatch_granularity_warns_on_the_cluster_configs(name, nodes):
    _, findings, _, _ = run_check(_args(CONFIGS / name, nodes, "loss_fn.bapo.granularity=microbatch"))
    warning = [f for f in findings if f.key == "loss_fn.bapo.granularity" and "responses" in f.message]
    assert len(warning) == 1 and warning[0].level == "warning"
    assert "set loss_fn.bapo.granularity=step" in warning[0].message
    _, findings, _, _ = run_check(_args(CONFIGS / name, nodes, "loss_fn.bapo.granularity=step"))
    assert not [f for f in findings if "responses per search" in f.message]


def test_measured_lengths_from_a_file(tmp_path):
    """850-token responses + 150-token prompts, rounded up to 64 -> 1,024 tokens: 34 per 34,816-token
    bin; the 7B config has DP 1, so a search sees 34 responses (from 3 consecutive groups: constant
    lengths keep the order), reported in --json."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# measured\n" + "850\n" * 10)
    args = _args(
        CONFIGS / "bapo_7b.yaml", 1, "loss_fn.bapo.granularity=microbatch", "--response-lengths", str(lengths)
    )
    out = json.loads(_json_check(args))
    assert out["bound_search"]["responses_median"] == 34816 // 1024
    assert 2 < out["bound_search"]["groups_mean"] <= 3


def _json_check(args):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        from bapo_nemo.plan.check_cli import main

        main(argparse.Namespace(**{**vars(args), "json": True}))
    return buf.getvalue()


def test_bad_length_file_is_a_one_line_error(tmp_path):
    bad = tmp_path / "lengths.txt"
    bad.write_text("1200\nabc\n")
    with pytest.raises(LengthModelError, match=r"lengths.txt:2: 'abc' is not a token count"):
        read_lengths(bad)
    code = cli_main(
        [
            "check",
            str(CONFIGS / "bapo_7b.yaml"),
            "--nodes",
            "1",
            "--gpus-per-node",
            "8",
            "--response-lengths",
            str(bad),
        ]
    )
    assert code == 1
    _, findings, _, _ = run_check(_args(CONFIGS / "bapo_7b.yaml", 1, "--pass-rate-beta", "1"))
    assert [f.key for f in findings if f.level == "error"] == ["--pass-rate-beta"]


@pytest.mark.parametrize("name,nodes", [("bapo_7b.yaml", 1), ("bapo_32b.yaml", 8), ("bapo_32b_64k.yaml", 8)])
def test_shipped_configs_search_whole_optimizer_steps(name, nodes):
    """The shipped configs use granularity=step: every search sees a full global batch of 256 responses
    from 16 prompt groups, so no search-statistics warning."""
    args = _args(CONFIGS / name, nodes)
    config, findings, _, _ = run_check(args)
    assert config["loss_fn"]["bapo"]["granularity"] == "step"
    assert not [f for f in findings if "responses per search" in f.message]
    stats = json.loads(_json_check(args))["bound_search"]
    assert stats["responses_p10"] == stats["responses_p90"] == 256 and stats["groups_mean"] == 16


def test_bad_length_model_is_an_error_naming_the_option():
    _, findings, _, _ = run_check(_args(CONFIGS / "bapo_7b.yaml", 1, "--response-length-median", "0"))
    assert [f.key for f in findings if f.level == "error"] == ["--response-length-median"]
