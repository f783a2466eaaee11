"""Data paths in a NeMo-RL config are checked where NeMo-RL will open them: relative prompt files against
the job's working directory (v0.7.0's `TaskDataSpec.__post_init__` raises FileNotFoundError for a missing
one right after `init_ray()`), absolute ones as they are."""

from __future__ import annotations

import json
from pathlib import Path

from bapo_nemo.plan.registry import check_config
from bapo_nemo.plan.rules.config_io import load_nemo_config
from bapo_nemo.plan.rules.path_checks import NEMO_RL_IMAGE_SOURCE, data_files
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def path_errors(config: dict, workdir: Path) -> dict[str, str]:
    return {
        f.key: f.message
        for f in check_config(config, None, None, check_paths=True, workdir=workdir)
        if f.level == "error" and f.key.endswith("prompt_file")
    }


def test_shipped_configs_open_no_prompt_file_relative_to_the_job_directory():
    """slurm/bapo_32b.sbatch runs the driver in the checkout (--container-workdir=$BAPO_REPO), which has no
    examples/prompts/: every prompt file of the shipped configs must be absolute."""
    for name in ("bapo_7b.yaml", "bapo_32b.yaml", "bapo_32b_64k.yaml"):
        config = load_nemo_config(CONFIGS / name)
        files = [(key, path) for key, path, is_file in data_files(config) if is_file]
        assert files, f"{name}: no prompt files found (the validation sets use one)"
        for key, path in files:
            assert path.startswith(NEMO_RL_IMAGE_SOURCE + "/examples/prompts/"), (name, key, path)
        assert path_errors(config, REPO) == {}


def test_a_relative_prompt_file_is_judged_from_the_job_working_directory(tmp_path):
    config = load_nemo_config(
        CONFIGS / "bapo_7b.yaml", ["data.validation.0.prompt_file=examples/prompts/cot.txt"]
    )
    errors = path_errors(config, REPO)
    assert set(errors) == {"data.validation[0].prompt_file"}
    assert f"{REPO}/examples/prompts/cot.txt does not exist" in errors["data.validation[0].prompt_file"]
    # The same relative path is fine where it exists.
    (tmp_path / "examples" / "prompts").mkdir(parents=True)
    (tmp_path / "examples" / "prompts" / "cot.txt").write_text("{}")
    assert path_errors(config, tmp_path) == {}


def test_bapo_nemo_check_takes_the_job_working_directory(tmp_path):
    """The CLI end to end: the same config fails from the checkout and passes with --workdir set to a
    directory that holds the prompt."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "cot.txt").write_text("{}")

    def check(*extra):
        result = cli_process.run(
            "check", str(CONFIGS / "bapo_7b.yaml"), "data.validation.0.prompt_file=prompts/cot.txt", "--nodes", "1",
            "--gpus-per-node", "8", "--json", *extra, cwd=REPO, env=cli_process.cli_env(), timeout=HANG_GUARD_S,
        )
        report = json.loads(result.stdout)
        return [f for f in report["findings"] if f["key"] == "data.validation[0].prompt_file"]

    assert [f["level"] for f in check()] == ["error"]
    assert check("--workdir", str(tmp_path)) == []
