"""`bapo-nemo check` refuses a length or count the run would cut without a word (plan/rules/length_checks.py):
each error names the key asked, the key that binds and a value that works, computed here by hand; the
driver's pre-flight refuses the same config before Ray starts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from bapo_nemo.plan.check_cli import configure_parser, run_check
from bapo_nemo.plan.rules.config_io import load_nemo_config
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
# bapo_32b: max_total_sequence_length 40,960, prompts up to 2,048 (data.max_input_seq_length), FP8
# blockwise with TP 8 x CP 4 and sequence parallel: lengths in multiples of 128 x 2*4 x 8 = 8,192.
ROOM = 40960 - 2048


def _args(config, nodes, *overrides):
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args([str(config), *overrides, "--nodes", str(nodes), "--gpus-per-node", "8"])


def _errors(findings) -> dict[str, str]:
    return {f.key: f.message for f in findings if f.level == "error"}


def test_more_new_tokens_than_the_sequence_holds_is_an_error_naming_both_keys(tmp_path):
    """The user's command: 131,072 new tokens in a 40,960-token sequence used to pass ("OK: 0 error(s)")."""
    argv = ["check", str(CONFIGS / "bapo_32b.yaml"), "--nodes", "4", "--gpus-per-node", "8", "++cluster.num_nodes=4",
            "policy.generation.max_new_tokens=131072"]
    env = cli_process.cli_env()
    text = cli_process.run(*argv, cwd=tmp_path, env=env, timeout=HANG_GUARD_S)
    assert text.returncode == 1 and text.stdout.strip().splitlines()[-1].startswith("FAILED: 1 error(s)"), text.stdout
    out = json.loads(cli_process.run(*argv, "--json", cwd=tmp_path, env=env, timeout=HANG_GUARD_S).stdout)
    message = _errors([argparse.Namespace(**f) for f in out["findings"]])["policy.generation.max_new_tokens"]
    assert "policy.max_total_sequence_length=40,960" in message and "data.max_input_seq_length" in message
    assert f"set policy.generation.max_new_tokens={ROOM}" in message
    assert f"policy.max_total_sequence_length to {17 * 8192}" in message  # 131,072 + 2,048 = 16.25 x 8,192
    fixed = cli_process.run(*argv[:-1], f"policy.generation.max_new_tokens={ROOM}", cwd=tmp_path, env=env,
                            timeout=HANG_GUARD_S)
    assert fixed.returncode == 0, fixed.stdout[-3000:]


@pytest.mark.parametrize("overrides,key,fragments", [
    # honoured only after prompts of up to 40,960 - 39,000 = 1,960 tokens
    (["policy.generation.max_new_tokens=39000"], "policy.generation.max_new_tokens",
     ["prompts longer than 1,960 tokens", f"max_new_tokens={ROOM}", f"to {6 * 8192}"]),
    # vLLM's max_model_len binds first: 30,000 - 2,048 = 27,952; 32,768 + 2,048 = 34,816 -> 5 x 8,192
    (["policy.generation.vllm_cfg.max_model_len=30000"], "policy.generation.max_new_tokens",
     ["policy.generation.vllm_cfg.max_model_len=30,000", "max_new_tokens=27952", f"to {5 * 8192}"]),
    # a response past max_total_sequence_length fails NeMo-RL's rollout
    (["policy.generation.vllm_cfg.max_model_len=50000"], "policy.generation.vllm_cfg.max_model_len",
     ["fails NeMo-RL's rollout", "set it to 40960"]),
    # the longest sequence is 2,048 + 32,768 = 34,816 tokens (a multiple of 64 already)
    (["policy.sequence_packing.train_mb_tokens=32768"], "policy.sequence_packing.train_mb_tokens",
     ["may reach 34,816 tokens", "at least 34816"]),
    (["policy.sequence_packing.logprob_mb_tokens=34000"], "policy.sequence_packing.logprob_mb_tokens",
     ["at least 34816"]),
    # 1,000 // 480 = 2 batches: 960 samples; the largest divisor of 1,000 up to 480 is 250
    (["grpo.max_val_samples=1000"], "grpo.max_val_samples", ["960 of them", "max_val_samples=960 or val_batch_size=250"]),
    (["grpo.max_val_samples=400"], "grpo.max_val_samples",
     ["no validation sample at all", "max_val_samples=480 or val_batch_size=400"]),
])
def test_each_silent_cap_is_an_error_with_a_value_that_works(overrides, key, fragments):
    _, findings, _, _ = run_check(_args(CONFIGS / "bapo_32b.yaml", 8, *overrides))
    message = _errors(findings).get(key, "")
    assert all(f in message for f in fragments), (fragments, _errors(findings))


def test_dynamic_batching_budgets_are_held_to_the_longest_sequence():
    """bapo_7b without packing: 34,816 tokens (max_new_tokens = max_total_sequence_length, NeMo-RL's "until
    the context is full"), rounded to sequence_length_round 64."""
    overrides = ["policy.megatron_cfg.context_parallel_size=1", "policy.sequence_packing.enabled=false",
                 "policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=20000"]
    _, findings, _, _ = run_check(_args(CONFIGS / "bapo_7b.yaml", 1, *overrides))
    errors = _errors(findings)
    assert "at least 34816" in errors["policy.dynamic_batching.train_mb_tokens"], errors
    assert "policy.generation.max_new_tokens" not in errors  # the shipped default is no request


def test_the_shipped_default_new_tokens_and_a_fitting_request_pass():
    for config, nodes, overrides in (("bapo_7b.yaml", 1, []), ("bapo_32b.yaml", 8, [f"policy.generation.max_new_tokens={ROOM}"])):
        _, findings, _, _ = run_check(_args(CONFIGS / config, nodes, *overrides))
        assert not _errors(findings), _errors(findings)


def test_the_driver_refuses_it_before_ray_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_rl", None)  # any import of it raises
    from bapo_nemo.nemo.driver import DriverConfigError, preflight, raise_on_errors

    with pytest.raises(DriverConfigError, match="policy.generation.max_new_tokens: 131,072 new tokens do not fit"):
        raise_on_errors(preflight(load_nemo_config(CONFIGS / "bapo_32b.yaml", ["policy.generation.max_new_tokens=131072"])))
