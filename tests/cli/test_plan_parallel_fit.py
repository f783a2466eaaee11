"""A parallel size that leaves the training GPUs short of whole replicas: `bapo-nemo check` names the size
the user changed (not TP whatever was changed) and the values that fit, worked out here by hand from
bapo_32b on 8 x 8 (TP 8, PP 1, CP 4, sequence parallel, make_sequence_length_divisible_by 64, 40 heads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bapo_nemo.plan.rules.models import BUILTIN
from bapo_nemo.plan.rules.parallel_fit import Layout, fitting, node_counts
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
MEGATRON = "policy.megatron_cfg"


def _check(tmp_path: Path, config: Path, *overrides: str) -> dict[str, str]:
    done = cli_process.run("check", str(config), *overrides, "--nodes", "8", "--gpus-per-node", "8", "--json",
                           cwd=tmp_path, env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    return {f["key"]: f["message"] for f in json.loads(done.stdout)["findings"] if f["level"] == "error"}


def test_the_size_changed_on_the_command_line_is_named_with_the_values_that_fit(tmp_path):
    """CP 3: 64 / (TP 8 x PP 1) = 8, divisors 1, 2, 4, 8; 2*CP x TP must divide 64, which drops 8. CP 3
    breaks that rule too, so no node count is offered."""
    errors = _check(tmp_path, REPO / "configs" / "bapo_32b.yaml", f"{MEGATRON}.context_parallel_size=3")
    assert list(errors) == [f"{MEGATRON}.context_parallel_size"], errors
    message = errors[f"{MEGATRON}.context_parallel_size"]
    assert message.startswith("3: 64 training GPUs are not a multiple of TP*PP*CP = 8*1*3 = 24")
    assert "CP can be 1, 2 or 4" in message and "nodes" not in message


def test_a_node_count_that_fits_no_replica_names_the_sizes_and_the_counts_that_fit(tmp_path):
    """6 nodes = 48 GPUs, replicas of 32: TP can be 48 / 4 = 12's divisors 1, 2, 4 (8 does not divide 12),
    CP 48 / 8 = 6's divisors 1, 2 (3 and 6 break 2*CP x TP | 64), PP none; 4 or 8 nodes hold whole ones."""
    done = cli_process.run("check", str(REPO / "configs" / "bapo_32b.yaml"), "++cluster.num_nodes=6", "--nodes", "6",
                           "--gpus-per-node", "8", "--json", cwd=tmp_path, env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    errors = {f["key"]: f["message"] for f in json.loads(done.stdout)["findings"] if f["level"] == "error"}
    assert sorted(errors) == [f"{MEGATRON}.context_parallel_size", f"{MEGATRON}.tensor_model_parallel_size"], errors
    assert "TP can be 1, 2 or 4" in errors[f"{MEGATRON}.tensor_model_parallel_size"]
    assert "CP can be 1 or 2" in errors[f"{MEGATRON}.context_parallel_size"]
    assert all("run on 4 or 8 nodes" in m for m in errors.values())


def test_a_copied_preset_edited_in_the_file_gets_the_size_that_can_be_fixed(tmp_path):
    """No override to go by: each size that can be fixed alone is named; with CP 3, TP (64 / 3) and PP
    (64 / 24) cannot, so CP alone."""
    text = (REPO / "configs" / "bapo_32b.yaml").read_text().replace("context_parallel_size: 4", "context_parallel_size: 3")
    text = text.replace("defaults: bapo_7b.yaml", f"defaults: {REPO / 'configs' / 'bapo_7b.yaml'}")
    (tmp_path / "mine.yaml").write_text(text)
    errors = _check(tmp_path, tmp_path / "mine.yaml")
    assert list(errors) == [f"{MEGATRON}.context_parallel_size"], errors
    assert "CP can be 1, 2 or 4" in errors[f"{MEGATRON}.context_parallel_size"]


@pytest.mark.parametrize("name,value,expected", [
    ("tp", 3, [1, 2, 4, 8]),  # 64 / (PP 1 x CP 4) = 16: 16 fails 2*4*16 | 64; 40 heads, 8 KV heads
    ("pp", 3, [1, 2]),  # 64 / (8 x 4) = 2
    ("cp", 3, [1, 2, 4]),
])
def test_fitting_values_by_hand(name, value, expected):
    layout = Layout(True, 8, 1, 4, True, 64)
    layout = Layout(**{**layout.__dict__, name: value})
    assert fitting(layout, name, 64, BUILTIN["deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"]) == expected


def test_the_heads_rule_keeps_tp_to_divisors_of_the_heads():
    """The 7B's 28 heads on one node of 8: TP 8 makes whole replicas but does not divide 28 heads."""
    layout = Layout(True, 3, 1, 1, False, 1)
    assert fitting(layout, "tp", 8, BUILTIN["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"]) == [1, 2, 4]


def test_node_counts_nearest_below_and_above():
    layout = Layout(True, 8, 1, 3, True, 64)  # 24 GPUs per replica
    assert node_counts(layout, 8, 8, 0) == [6, 9]
    assert node_counts(layout, 8, 8, 16) == [5, 8 + 3]  # 2 generation nodes: 8n - 16 a multiple of 24
