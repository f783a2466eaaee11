"""`bapo-nemo check` on partial rollouts: the bad `partial_rollouts:` blocks are errors naming the key,
the generation report (tokens/s and step with and without them, the budget sweep, BAPO's share, the
state a checkpoint carries) is consistent with the step estimate, and the warnings fire when a config's
choice is far from the best step. The simulated cases run on NeMo-RL's 4k-token Qwen3-32B recipe (a few
seconds each); the shipped presets are checked for what they promise."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from bapo_nemo.cli import main as cli_main
from bapo_nemo.plan.check_cli import configure_parser, run_check
from bapo_nemo.plan.rules.signal_lead import signal_line
from bapo_nemo.plan.simulation.generation_check import (
    DRIVER_BYTES_PER_TOKEN,
    STATE_JSON_BYTES_PER_TOKEN,
    budget_grid,
)
from bapo_nemo.rollout import GenerationChunk, PartialRolloutConfig, PartialRolloutManager, PromptItem
from tests.support.presets import QWEN3_32B_RECIPE

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
HEAVY_TAIL = ("--response-length-median", "200", "--response-length-sigma", "1.8")


def _errors(config: Path, nodes: int, *overrides: str) -> dict[str, str]:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args([str(config), *overrides, "--nodes", str(nodes), "--gpus-per-node", "8", "--no-path-checks"])
    return {f.key: f.message for f in run_check(args)[1] if f.level == "error"}


@pytest.mark.parametrize(
    "overrides,key,fragment",
    [
        # a budget larger than the response cap (policy.generation.max_new_tokens = 32,768)
        (["++partial_rollouts.token_budget=40000"], "partial_rollouts.token_budget", "larger than the response cap 32768"),
        # resumptions that let a response outgrow max_total_sequence_length: 5 x 8,192 + 2,048 > 40,960
        (
            ["++partial_rollouts.token_budget=8192", "++partial_rollouts.max_resumptions=4",
             "++partial_rollouts.max_response_tokens=60000"],
            "partial_rollouts.max_resumptions",
            "exceeds policy.max_total_sequence_length=40960: lower it to at most 38912",
        ),
        # the same through the response cap
        (
            ["++partial_rollouts.token_budget=8192", "++partial_rollouts.max_resumptions=9",
             "++partial_rollouts.max_response_tokens=60000"],
            "partial_rollouts.max_response_tokens",
            "a response may grow to 60000 tokens",
        ),
        # a budget the packing bin cannot hold after the prompt: 2,048 + 16,384 > 16,384
        (
            ["++partial_rollouts.token_budget=16384", "policy.sequence_packing.train_mb_tokens=16384"],
            "partial_rollouts.token_budget",
            "policy.sequence_packing.train_mb_tokens=16384",
        ),
        (["++partial_rollouts.token_budget=4096", "++partial_rollouts.prefill_batches=-1"],
         "partial_rollouts.prefill_batches", "an int >= 0"),
    ],
)
def test_bad_partial_rollout_blocks_name_the_key(overrides, key, fragment):
    errors = _errors(CONFIGS / "bapo_32b.yaml", 8, *overrides)
    assert key in errors and fragment in errors[key], errors


def test_a_resumption_cap_below_the_response_cap_is_a_warning():
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(
        [str(CONFIGS / "bapo_32b_partial.yaml"), "partial_rollouts.token_budget=8192", "--nodes", "8",
         "--gpus-per-node", "8", "--no-path-checks"]
    )
    findings = run_check(args)[1]
    [warning] = [f for f in findings if f.key == "partial_rollouts.max_resumptions"]
    assert warning.level == "warning" and "cut at 16384 tokens" in warning.message and "set it to 3" in warning.message


def test_shipped_presets_pass_the_block_rules():
    for name in ("bapo_32b_64k.yaml", "bapo_32b_partial.yaml"):
        assert _errors(CONFIGS / name, 8) == {}, name


def _check(capsys, config: Path, nodes: int, *argv: str) -> tuple[int, dict]:
    rc = cli_main(["check", str(config), *argv, "--nodes", str(nodes), "--gpus-per-node", "8", "--no-path-checks", "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "qwen3_32b_4n8g.yaml"
    path.write_text(QWEN3_32B_RECIPE)
    return path


def _block(budget: int, resumptions: int) -> tuple[str, ...]:
    return (
        f"++partial_rollouts.token_budget={budget}",
        f"++partial_rollouts.max_resumptions={resumptions}",
        "loss_fn.use_importance_sampling_correction=true",
    )


def _warnings(out: dict) -> dict[str, str]:
    return {f["key"]: f["message"] for f in out["findings"] if f["level"] == "warning" and f["key"].startswith("partial")}


def test_check_reports_the_step_with_and_without_partial_rollouts(capsys, recipe):
    """With a block, the step estimate (and the signal lead) is the config's own choice; the report holds
    both sides, the sweep over cap/8, cap/4, cap/2 (3,946-token responses: 512, 1,024, 2,048) and the
    config's budget, and the partial-rollout state in the save."""
    rc, out = _check(capsys, recipe, 4, *_block(1024, 3), *HEAVY_TAIL)
    assert rc == 0
    gen, step = out["generation"], out["step_time_s"]
    assert set(gen["budget_sweep"]) == {"512", "1024", "2048"} and budget_grid(3946, 1024) == [512, 1024, 2048]
    configured, without = gen["configured"], gen["without_partial_rollouts"]
    assert configured == gen["budget_sweep"]["1024"]  # the config's budget is one of the sweep's
    assert step["generation"] == pytest.approx(configured["generation_s"])
    base = gen["step_time_without_partial_rollouts_s"]
    assert step["training"] == base["training"] and step["logprob_passes"] == base["logprob_passes"]
    # the step compares as the same tokens over each side's tokens/s
    assert configured["generation_s"] / without["generation_s"] == pytest.approx(1 / configured["speedup"])
    assert configured["speedup"] == pytest.approx(
        configured["generated_tokens_per_s"] / without["generated_tokens_per_s"]
    )
    assert str(gen["best_budget"]) == min(gen["budget_sweep"], key=lambda b: gen["budget_sweep"][b]["generation_s"])
    # the in-flight state is written with every checkpoint
    state = gen["partial_rollout_state_gb"]
    assert state["checkpoint_json"] == pytest.approx(configured["in_flight_tokens"] * STATE_JSON_BYTES_PER_TOKEN / 1e9)
    assert step["save"] > base["save"]
    assert 0 < configured["stale_token_share"] <= 1 and configured["staleness_mean"] > 0
    # no BAPO block in NeMo-RL's recipe: nothing of BAPO's in the step
    assert step["bapo_share"] == 0


def test_check_warns_when_the_choice_is_far_from_the_best_step(capsys, recipe):
    """Heavy-tailed lengths on the 4k recipe: without a block, partial rollouts would shorten the step
    by more than 15% (the presets' bar); a budget of 512 gives a step 10% longer than the best; a budget
    of 256 makes the step longer than no partial rollouts at all."""
    _, none = _check(capsys, recipe, 4, *HEAVY_TAIL)
    [message] = _warnings(none).values()
    assert "partial_rollouts" in _warnings(none) and "add a partial_rollouts: block" in message
    gen = none["generation"]
    best = gen["budget_sweep"][str(gen["best_budget"])]["generation_s"]
    rest = none["step_time_s"]["step"] - none["step_time_s"]["generation"]
    assert best + rest <= 0.85 * none["step_time_s"]["step"]

    _, far = _check(capsys, recipe, 4, *_block(512, 7), *HEAVY_TAIL)
    assert set(_warnings(far)) == {"partial_rollouts.token_budget"}
    assert f"token_budget {far['generation']['best_budget']} gives" in _warnings(far)["partial_rollouts.token_budget"]

    _, worse = _check(capsys, recipe, 4, *_block(256, 15), *HEAVY_TAIL)
    assert "make the step longer" in _warnings(worse)["partial_rollouts"]


def test_shipped_presets_hold_what_their_comments_promise(capsys):
    """bapo_32b_64k ships partial rollouts: faster generation, a shorter step, and a lead its script
    covers; bapo_32b ships without them (they shorten its step by less than the 15% bar), so check does
    not suggest them there. BAPO's own cost is reported on both."""
    _, long = _check(capsys, CONFIGS / "bapo_32b_64k.yaml", 8)
    gen = long["generation"]
    assert gen["configured"]["speedup"] > 1.2
    assert long["step_time_s"]["step"] < 0.85 * gen["step_time_without_partial_rollouts_s"]["step"]
    assert gen["configured"]["staleness_mean"] <= 2
    assert signal_line(ROOT / "slurm" / "bapo_32b.sbatch").seconds >= long["step_time_s"]["recommended_signal_lead"]
    assert not _warnings(long)
    _, short = _check(capsys, CONFIGS / "bapo_32b.yaml", 8)
    assert short["generation"]["configured"] is None and not _warnings(short)
    assert 0.03 < short["step_time_s"]["bapo_share"] < 0.06


def test_state_sizes_per_token_are_measured():
    """STATE_JSON_BYTES_PER_TOKEN and DRIVER_BYTES_PER_TOKEN against a real PartialRolloutManager holding
    random token ids of a 152k vocabulary and float log-probs (within 15%)."""
    import tracemalloc

    rng = random.Random(0)
    tracemalloc.start()
    try:
        manager = PartialRolloutManager(PartialRolloutConfig(token_budget=500, max_resumptions=10), 4)
        manager.add_prompts([PromptItem(str(i), [rng.randrange(152064) for _ in range(10)], {}) for i in range(8)])
        before = tracemalloc.take_snapshot()

        def generate(contexts, max_new):
            return [
                GenerationChunk(
                    [rng.randrange(152064) for _ in range(max_new)],
                    [-rng.expovariate(1.0) for _ in range(max_new)],
                    False,
                )
                for _ in contexts
            ]

        for _ in range(2):
            manager.run_iteration(generate, 0)
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    tokens = 32 * 1000
    assert len(json.dumps(manager.state_dict())) / tokens == pytest.approx(STATE_JSON_BYTES_PER_TOKEN, rel=0.15)
    assert grown / tokens == pytest.approx(DRIVER_BYTES_PER_TOKEN, rel=0.15)
