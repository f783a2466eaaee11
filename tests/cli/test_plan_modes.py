"""`bapo-nemo check`'s modes side by side (plan/simulation/mode_compare.py): each async mode at its best split (the
split search by hand), the presets' rule, an async config's own step and pipeline, and two things a user
saw on screen (`--help` without the `--gpu` default; a budget sweep shown as if partial rollouts were
on), run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_nemo.cli import main as cli_main
from bapo_nemo.plan.rules.cluster_plan import plan_cluster
from bapo_nemo.plan.rules.config_io import load_nemo_config
from bapo_nemo.plan.rules.memory import estimate
from bapo_nemo.plan.rules.models import BUILTIN
from bapo_nemo.plan.simulation.mode_compare import ModeComparison, ModeResult, async_splits, async_warnings
from tests.support.presets import ASYNC_32B

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def test_a_runnable_async_config_passes_and_reports_its_own_pipeline(capsys):
    """No error; the step estimate is the async loop's; the JSON carries its pipeline and the modes, its
    own among them."""
    assert cli_main(["check", str(CONFIGS / "bapo_32b.yaml"), *ASYNC_32B, "--nodes", "8", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "this config's async GRPO on its split" in out and "with async GRPO" in out
    assert "a checkpoint keeps" in out and "token_budget" not in out  # no partial rollouts with async
    args = ["check", str(CONFIGS / "bapo_32b.yaml"), *ASYNC_32B, "--nodes", "8", "--gpus-per-node", "8", "--json"]
    assert cli_main(args) == 0
    result = json.loads(capsys.readouterr().out)
    own = result["generation"]["async_grpo"]
    modes = {m["mode"]: m for m in result["generation"]["modes"]}
    # the search finds the config's own mode on its own split too: one row, the config's
    assert [m["mode"] for m in result["generation"]["modes"] if "in-flight, age 1" in m["mode"]] == [
        "async + in-flight, age 1 (this config)"
    ]
    mine = modes["async + in-flight, age 1 (this config)"]
    assert mine["this_config"] and mine["vs_this_config"] == 1.0
    assert mine["split"] == "32 gen + 32 train (TP8 PP1 CP4 DP1)"
    # the signal lead is sized from the async step: waiting + passes = the simulated step
    assert result["step_time_s"]["step"] == pytest.approx(mine["step_s"], rel=1e-6)
    assert own["requeue_lost_groups"] > 0 and own["cold_fill_s"] > 0


def test_split_search_on_64_gpus_by_hand():
    """bapo_32b's training replica is TP 8 x CP 4 = 32 GPUs, halved to CP 2 (16) or CP 1 (8) where it must,
    and train_global_batch_size is 256. Generation takes whole nodes, leaving 56, 48, 40, 32, 24, 16 or 8
    training GPUs: 56, 40 and 24 hold only TP 8 replicas, 7, 5 or 3 of them, and 48 holds 3 at CP 2 or 6
    at CP 1: no DP size that divides 256. 32 holds one at CP 4, 16 one at CP 2. 8 would need CP 1: a
    40,960-token micro-batch on one TP group, which the memory model does not fit."""
    config = load_nemo_config(CONFIGS / "bapo_32b.yaml")
    model = BUILTIN["deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"]
    splits = async_splits(config, 8, 8, model, "h100-80gb")
    assert [(s.generation_gpus, s.plan.train_gpus, s.plan.parallel.cp) for s in splits] == [(32, 32, 4), (48, 16, 2)]
    eight, _ = plan_cluster(
        load_nemo_config(CONFIGS / "bapo_32b.yaml", [
            "policy.generation.colocated.enabled=false",
            "++policy.generation.colocated.resources={num_nodes: 7, gpus_per_node: 8}",
            "policy.megatron_cfg.context_parallel_size=1",
        ]), 8, 8)
    assert not estimate(model, eight.parallel, eight.training, eight.generation, "h100-80gb").fits
    for s in splits:  # dedicated generation GPUs get NeMo-RL's async share of memory
        assert s.config["policy"]["generation"]["vllm_cfg"]["gpu_memory_utilization"] == 0.8


def _row(mode, tokens_per_hour, staleness, setting=None) -> ModeResult:
    return ModeResult(mode, "split", 64, step_s=3600.0, tokens_per_step=tokens_per_hour, generation_idle_s=0.0,
                      train_idle_s=0.0, staleness_mean=staleness, staleness_max=staleness, setting=setting)


def test_the_presets_rule():
    """At least 1.15x the tokens trained per hour of the config's own mode, at a mean age of at most 2."""
    shipped = _row("sync", 100.0, 0.0)
    for other, warned in (
        (_row("async", 116.0, 1.5, setting=object()), True),
        (_row("async", 114.0, 1.0, setting=object()), False),  # not enough
        (_row("async", 150.0, 2.5, setting=object()), False),  # too stale
    ):
        findings = async_warnings(ModeComparison([shipped, other], shipped, splits=1))
        assert bool(findings) == warned, (other, findings)
        if warned:
            assert findings[0].key == "grpo.async_grpo" and "1.16x" in findings[0].message


def test_check_help_shows_the_gpu_default():
    out = subprocess.run([sys.executable, "-m", "bapo_nemo.cli", "check", "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    assert "default: h100-80gb" in " ".join(out.split())


def test_check_says_partial_rollouts_are_off_and_compares_the_modes():
    """bapo_32b has no partial_rollouts block: check shows what they would do, as a what-if, not as the
    config's sweep; the modes table follows, labelled as simulated."""
    run = subprocess.run(
        [sys.executable, "-m", "bapo_nemo.cli", "check", str(CONFIGS / "bapo_32b.yaml"), "--nodes", "8",
         "--gpus-per-node", "8"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )
    out = " ".join(run.stdout.split())
    assert run.returncode == 0, run.stdout + run.stderr
    assert "token_budget sweep" not in out
    assert "partial rollouts are off in this config. Turned on" in out
    assert "GRPO modes on these GPUs, each at its best split (simulated, a planning figure)" in out
    assert "async, age 1" in out and "32 gen + 32 train" in out
