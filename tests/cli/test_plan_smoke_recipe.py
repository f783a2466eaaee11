"""docs/cluster.md's run costs and its smoke run before the first 64-GPU run: the recipe's `bapo-nemo check`
command, read from the doc's text, passes, and the cost the doc states for it (and for the 64-GPU run) is
the one `check` prints; the GPUs `--gpu` takes know FP8 where their data sheets say so."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from bapo_nemo.plan.precompute import SMOKE_32B
from bapo_nemo.plan.rules.gpus import GPUS
from bapo_nemo.plan.simulation.run_cost import saves, validations
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "cluster.md").read_text()
RECIPE = DOC.split("### Before the first 64-GPU run: a 2-step smoke run", 1)[1].split("\n#", 1)[0]


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _recipe_commands() -> tuple[list[str], list[str], str]:
    """(SMOKE's overrides, the check command's argv with $SMOKE expanded, the sbatch line)."""
    [block] = re.findall(r"```bash\n(.*?)```", RECIPE, flags=re.DOTALL)
    lines = block.strip().splitlines()
    smoke = shlex.split(lines[0].split("=", 1)[1])[0].split()
    check = [word for w in shlex.split(lines[1]) for word in (smoke if w == "$SMOKE" else [w])]
    return smoke, check, lines[2]


def _check_json(argv: list[str], tmp_path: Path) -> dict:
    done = cli_process.run(*argv, "--json", cwd=REPO, env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_smoke_recipe_passes_check_at_the_cost_the_doc_states(tmp_path):
    smoke, check, sbatch = _recipe_commands()
    assert check[:2] == ["bapo-nemo", "check"]
    out = _check_json(check[1:], tmp_path)
    cost = out["run_cost"]
    stated = re.search(r"What it costs by `check`'s own figure: (\d+) steps x ([\d,]+) s \+ (\d+) validations x ([\d,]+) s "
                       r"\+ (\d+) saves x ([\d,]+) s =\s+([\d,]+) s \((\d+) minutes\) on (\d+) GPUs = ([\d.]+) GPU-hours", RECIPE)
    steps, step_s, vals, val_s, n_saves, save_s, total, minutes, gpus, gpu_hours = map(_number, stated.groups())
    assert (steps, vals, n_saves, gpus) == (cost["steps"], cost["validations"], cost["saves"], cost["gpus"])
    assert (step_s, val_s, save_s) == (round(cost["step_s"]), round(cost["validation_s"]), round(cost["save_s"]))
    assert total == round(cost["seconds"]) and minutes == round(cost["seconds"] / 60)
    assert gpu_hours == round(cost["gpu_hours"], 1)
    # the job runs what was checked: same overrides, node count, its own run directory
    assert ["++cluster.num_nodes=2", *smoke] == SMOKE_32B  # precomputed.json holds its simulations
    assert check[check.index("--nodes") + 1] == "2" and "--nodes=2" in sbatch.split()
    assert 'EXTRA_ARGS="$SMOKE"' in sbatch and "OUTPUT_DIR=$PWD/results/bapo_32b_smoke" in sbatch
    # the doc's memory figure for it
    peak = re.search(r"training peak of ([\d.]+) of (\d+) GB", RECIPE).groups()
    assert (float(peak[0]), float(peak[1])) == (round(out["memory_gb"]["training_peak"], 1), out["memory_gb"]["capacity"])


def test_the_64_gpu_run_costs_what_the_doc_says(tmp_path):
    out = _check_json(["check", "configs/bapo_32b.yaml", "--nodes", "8", "--gpus-per-node", "8"], tmp_path)
    cost = out["run_cost"]
    stated = re.search(r"1,000 steps x (\d+) s \+ (\d+) validations x (\d+) s \+\s+(\d+) saves x (\d+) s = ([\d,]+) s "
                       r"\(([\d.]+) days\) = ([\d,]+) GPU-hours", DOC)
    step_s, vals, val_s, n_saves, save_s, total, days, gpu_hours = map(_number, stated.groups())
    assert cost["steps"] == 1000 and (vals, n_saves) == (cost["validations"], cost["saves"])
    assert (step_s, val_s, save_s) == (round(cost["step_s"]), round(cost["validation_s"]), round(cost["save_s"]))
    assert total == round(cost["seconds"]) and days == round(cost["seconds"] / 86400, 1)
    assert gpu_hours == round(cost["gpu_hours"])
    assert cost["gpu_hours"] == pytest.approx(cost["seconds"] * 64 / 3600)


@pytest.mark.parametrize("grpo,checkpointing,expected", [
    # 1,000 steps: before step 1, every 10th (100; the last among them), saves every 5th (200)
    ({"val_at_start": True, "val_period": 10, "val_at_end": True}, {"save_period": 5}, (101, 200)),
    # 7 steps, every 3rd: after 3 and 6, and the last (7) with val_at_end; saves after 3, 6 and the last
    ({"val_at_start": False, "val_period": 3, "val_at_end": True}, {"save_period": 3}, (3, 3)),
    ({"val_at_start": False, "val_period": 0, "val_at_end": False}, {"enabled": False}, (0, 0)),
])
def test_validations_and_saves_counted_as_grpo_train_makes_them(grpo, checkpointing, expected):
    steps = 1000 if grpo["val_period"] == 10 else 7
    config = {"grpo": grpo, "checkpointing": {"enabled": True, **checkpointing}}
    assert (validations(config, steps), saves(config, steps)) == expected


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_an_error_naming_both_keys(tmp_path):
    """bapo_32b trains (Transformer Engine) and generates (vLLM) in FP8: on the A100 both are errors, and
    the config with both set to bf16 passes there."""
    argv = ["check", "configs/bapo_32b.yaml", "--nodes", "8", "--gpus-per-node", "8", "--gpu", "a100-80gb", "--json"]
    done = cli_process.run(*argv, cwd=REPO, env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    errors = {f["key"]: f["message"] for f in json.loads(done.stdout)["findings"] if f["level"] == "error"}
    assert done.returncode == 1 and sorted(errors) == ["policy.generation.vllm_cfg.precision",
                                                       "policy.megatron_cfg.fp8_cfg.enabled"], errors
    assert "set it false" in errors["policy.megatron_cfg.fp8_cfg.enabled"]
    assert "set it to bfloat16" in errors["policy.generation.vllm_cfg.precision"]
    bf16 = ["policy.megatron_cfg.fp8_cfg.enabled=false", "policy.generation.vllm_cfg.precision=bfloat16"]
    fixed = cli_process.run(*argv[:-1], *bf16, cwd=REPO, env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    assert fixed.returncode == 0, fixed.stdout[-3000:]


def test_the_data_sheet_figures():
    """Dense peaks are half the data sheets' "with sparsity" figures; B200's are the DGX B200's (8 GPUs)
    divided by 8."""
    assert GPUS["a100-80gb"].fp8_flops is None and GPUS["a100-80gb"].bf16_flops == 624e12 / 2
    assert GPUS["h100-80gb"].bf16_flops == pytest.approx(1979e12 / 2, rel=1e-3)
    assert GPUS["h100-80gb"].fp8_flops == pytest.approx(3958e12 / 2, rel=1e-3)
    assert GPUS["b200-180gb"].memory_gb == 1440 / 8 and GPUS["b200-180gb"].hbm_bytes_per_s == 64e12 / 8
    assert GPUS["b200-180gb"].fp8_flops == 72e15 / 8 / 2 and GPUS["b200-180gb"].bf16_flops == 72e15 / 8 / 4
