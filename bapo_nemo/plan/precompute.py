"""Writes plan/simulation/precomputed.json: every simulation `bapo-nemo check` runs on the shipped presets (with its
default options), computed afresh, so a first `check` of a preset answers without simulating. Run it
after changing a simulator or its inputs (tests/unit/test_plan_sim_cache.py fails until then):

    python -m bapo_nemo.plan.precompute
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path

from bapo_nemo.plan.simulation import sim_cache

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# bapo_32b as an async run: 4 generation nodes, the training replica TP 8 x CP 4 on the other 4.
ASYNC_32B = [
    "grpo.async_grpo.enabled=true",
    "grpo.async_grpo.in_flight_weight_updates=true",
    "policy.generation.colocated.enabled=false",
    "++policy.generation.colocated.resources={num_nodes: 4, gpus_per_node: 8}",
    "policy.generation.vllm_cfg.async_engine=true",
    "policy.generation.vllm_cfg.gpu_memory_utilization=0.8",
]
# The 2-node smoke run of docs/cluster.md ("Before the first 64-GPU run"; tests/cli/test_plan_smoke_recipe.py
# holds the two equal).
SMOKE_32B = [
    "++cluster.num_nodes=2",
    "policy.megatron_cfg.context_parallel_size=2",
    "grpo.max_num_steps=2",
    "grpo.num_prompts_per_step=8",
    "policy.train_global_batch_size=32",
    "grpo.val_at_start=false",
    "grpo.max_val_samples=32",
    "grpo.val_batch_size=32",
    "logger.mlflow.run_name=bapo_32b_smoke",
]
# `bapo-nemo check` argv of each shipped run.
PRESET_RUNS: dict[str, list[str]] = {
    "bapo_7b": ["bapo_7b.yaml", "--nodes", "1", "--gpus-per-node", "8"],
    "bapo_32b": ["bapo_32b.yaml", "--nodes", "8", "--gpus-per-node", "8"],
    "bapo_32b_64k": ["bapo_32b_64k.yaml", "--nodes", "8", "--gpus-per-node", "8"],
    "bapo_32b_partial": ["bapo_32b_partial.yaml", "--nodes", "8", "--gpus-per-node", "8"],
    "bapo_32b_async": ["bapo_32b.yaml", *ASYNC_32B, "--nodes", "8", "--gpus-per-node", "8"],
    "bapo_32b_smoke": ["bapo_32b.yaml", *SMOKE_32B, "--nodes", "2", "--gpus-per-node", "8"],
}


def check_argv(name: str) -> list[str]:
    """The argv after `bapo-nemo check` of a shipped run."""
    config, *rest = PRESET_RUNS[name]
    return [str(CONFIGS / config), *rest]


def run_check_quietly(argv: list[str]) -> int:
    """`bapo-nemo check ARGV` in this process, its output dropped; the exit status."""
    from bapo_nemo.plan import check_cli

    parser = argparse.ArgumentParser()
    check_cli.configure_parser(parser)
    args = parser.parse_intermixed_args(argv)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return check_cli.main(args)


def main() -> None:
    os.environ[sim_cache.CACHE_ENV] = "off"  # nothing read from or written to the user's cache
    sim_cache.forget()
    sim_cache.use_shipped = False  # every result computed afresh
    for name in PRESET_RUNS:
        run_check_quietly(check_argv(name))
    entries = {key: sim_cache.encode(sim_cache.result(key)) for key in sorted(sim_cache.calls)}
    sim_cache.SHIPPED.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    print(f"{sim_cache.SHIPPED}: {len(entries)} simulations of {len(PRESET_RUNS)} runs")


if __name__ == "__main__":
    main()
