"""Run-config schema of the embedded trainer: key errors name the key, overrides are checked, the loss
presets are what they claim, and resume compatibility ignores only the harmless keys."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from bapo_nemo.algorithm import search_clip_bounds
from bapo_nemo.embedded.config.run_config import RunConfigError, load_config, validate_config
from bapo_nemo.embedded.run.resume import config_differences
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def test_default_config_file_loads():
    cfg = load_config(REPO / "configs" / "local_cpu.yaml")
    partial = cfg.partial_rollouts
    assert cfg.loss_fn.bapo.enabled and partial.token_budget < partial.max_response_tokens


def test_unknown_yaml_key_names_the_key_and_close_matches(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("grpo:\n  max_num_step: 3\nloss_fn:\n  bapo:\n    rh0: 0.5\n")
    with pytest.raises(RunConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert str(path) in msg
    assert "grpo.max_num_step: unknown key" in msg and "grpo.max_num_steps" in msg
    assert "loss_fn.bapo.rh0: unknown key" in msg and "loss_fn.bapo.rho0" in msg


def test_unknown_override_key_is_an_error_listing_close_matches():
    with pytest.raises(
        RunConfigError, match=r"unknown config key 'policy.optimizer.kwargs.learning_rate'.*did you mean"
    ) as exc:
        load_config(None, ["policy.optimizer.kwargs.learning_rate=0.1"])
    assert "policy.optimizer.kwargs.lr" in str(exc.value) or "warmup.lr" in str(exc.value)
    with pytest.raises(RunConfigError, match="key.sub=value"):
        load_config(None, ["policy.optimizer.kwargs.lr"])


def test_override_values_are_parsed_and_validated_with_the_yaml_key():
    cfg = load_config(None, ["loss_fn.bapo.rho0=0.5", "grpo.max_num_steps=7", "loss_fn.bapo.dual_clip=null"])
    assert cfg.loss_fn.bapo.rho0 == 0.5 and cfg.grpo.max_num_steps == 7 and cfg.loss_fn.bapo.dual_clip is None
    with pytest.raises(RunConfigError, match=r"loss_fn\.bapo\.rho0: rho0 must be"):
        load_config(None, ["loss_fn.bapo.rho0=1.5"])
    with pytest.raises(RunConfigError, match=r"loss_fn\.bapo\.ratio_reference"):
        load_config(None, ["loss_fn.bapo.ratio_reference=current"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["loss_fn.bapo.enabled=false", "loss_fn.bapo.c_low_min=0.8", "loss_fn.bapo.c_high_min=1.2"],
            (0.8, 1.2),
        ),
        (
            ["loss_fn.bapo.enabled=false", "loss_fn.bapo.c_low_min=0.8", "loss_fn.bapo.c_high_min=1.28"],
            (0.8, 1.28),
        ),
    ],
)
def test_baseline_presets_are_fixed_bounds(overrides, expected):
    """Fixed clip and clip-higher are BAPO disabled with other starting bounds. A batch whose positive
    share is far below rho0 (one positive token against 9 negatives) would move BAPO's bounds; disabled,
    the bounds stay at the starts."""
    bapo = load_config(None, overrides).loss_fn.bapo
    ratio = torch.tensor([[1.5] + [1.0] * 9])
    adv = torch.tensor([[1.0] + [-1.0] * 9])
    result = search_clip_bounds(ratio, adv, torch.ones_like(ratio), bapo)
    assert (result.c_low, result.c_high) == pytest.approx(expected)
    assert result.steps == 0
    enabled = load_config(None, ["loss_fn.bapo.c_low_min=0.8"]).loss_fn.bapo
    moved = search_clip_bounds(ratio, adv, torch.ones_like(ratio), enabled)
    assert moved.steps > 0  # the same batch does move the adaptive bounds


def test_lengths_must_fit_the_model():
    with pytest.raises(RunConfigError, match="max_position_embeddings"):
        load_config(None, ["model.max_position_embeddings=32", "partial_rollouts.max_response_tokens=80"])


def test_config_differences_ignore_only_harmless_keys():
    a = validate_config({}).to_dict()
    b = validate_config(
        {
            "grpo": {"max_num_steps": 999},
            "checkpointing": {"save_period": 3},
            "logger": {"mlflow": {"run_name": "x"}},
        }
    ).to_dict()
    assert config_differences(a, b) == []
    c = validate_config({"model": {"hidden_size": 64}, "loss_fn": {"bapo": {"rho0": 0.5}}}).to_dict()
    diffs = config_differences(a, c)
    assert [d.split(":")[0] for d in diffs] == ["loss_fn.bapo.rho0", "model.hidden_size"]
    assert "checkpoint=128, now=64" in diffs[1]


def test_resume_treats_a_key_added_since_the_checkpoint_as_its_default():
    from bapo_nemo.embedded.config.run_config import RunConfig

    current = RunConfig().to_dict()
    saved = RunConfig().to_dict()
    del saved["warmup"]["step_error_rate"]  # written by an older version that did not know the key
    assert config_differences(saved, current) == []
    # ... but a run that sets the new key to a non-default value does differ.
    changed = RunConfig.model_validate({**current, "warmup": {**current["warmup"], "step_error_rate": 0.3}})
    diffs = config_differences(saved, changed.to_dict())
    assert len(diffs) == 1 and diffs[0].startswith("warmup.step_error_rate: checkpoint=")


# ---- one vocabulary with NeMo-RL ------------------------------------------------------------------------
def _key_table() -> dict[str, str]:
    """docs/embedded.md's "Config keys" table: embedded key (or `section.*`) -> its NeMo-RL cell."""
    text = (REPO / "docs" / "embedded.md").read_text()
    section = text.split("## Config keys", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        ours, theirs = (cell.strip() for cell in row.strip("|").split("|")[:2])
        for key in re.findall(r"`([^`]+)`", ours):
            table[key] = theirs
    return table


def test_key_table_covers_every_key_of_the_schema():
    from bapo_nemo.embedded.config.key_names import all_keys
    from bapo_nemo.embedded.config.run_config import RunConfig

    table = _key_table()
    sections = {k for k in all_keys(RunConfig) for other in all_keys(RunConfig) if other.startswith(k + ".")}
    leaves = [k for k in all_keys(RunConfig) if k not in sections]

    def covered(key: str) -> bool:
        return key in table or any(k.endswith(".*") and key.startswith(k[:-1]) for k in table)

    assert [k for k in leaves if not covered(k)] == []
    # and the table names no key the schema does not have
    stale = [k for k in table if not k.endswith(".*") and k not in leaves]
    assert stale == [] and all(k[:-2] in sections for k in table if k.endswith(".*"))


def test_every_counterpart_the_table_names_exists_in_nemo_rl_v070():
    from bapo_nemo.algorithm.options import BAPOBlock
    from bapo_nemo.embedded.config.run_config import LossFnConfig, RunConfig
    from bapo_nemo.plan.rules.config_io import load_nemo_config
    from bapo_nemo.plan.rules.schema import OWN_SECTIONS, known_keys
    from bapo_nemo.rollout import PartialRolloutConfig

    # The blocks bapo-nemo adds to a NeMo-RL config (`bapo-nemo check` and the driver read them there):
    # the embedded config holds the same schemas.
    ours = {"loss_fn.bapo.*", "partial_rollouts.*"}
    assert set(OWN_SECTIONS) == {key[:-2] for key in ours}
    cluster_bapo = load_nemo_config(REPO / "configs" / "bapo_32b.yaml")["loss_fn"]["bapo"]
    assert LossFnConfig.model_fields["bapo"].annotation is BAPOBlock
    assert set(cluster_bapo) <= set(BAPOBlock.model_fields)
    assert RunConfig.model_fields["partial_rollouts"].annotation is PartialRolloutConfig
    named = {key: cell for key, cell in _key_table().items() if cell != "none"}
    assert len(named) > 20
    for key, cell in named.items():
        counterpart = cell.strip("`")
        assert counterpart == key, f"{key}: the table names {cell}; a shared key keeps NeMo-RL's name"
        if key in ours:
            continue
        # v0.7.0's key list holds its data entries' fields too (ResponseDatasetConfig, read from its types)
        assert key in known_keys("v0.7.0"), f"{key} is not a NeMo-RL v0.7.0 config key"


def test_a_bapo_block_tuned_on_one_machine_pastes_into_a_cluster_config(tmp_path):
    """The embedded `loss_fn.bapo` and the cluster configs' are one schema: each side's block loads on the
    other side with the same settings."""
    from bapo_nemo.algorithm.options import NemoBAPOOptions
    from bapo_nemo.plan.rules.config_io import load_nemo_config

    laptop = yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text())["loss_fn"]["bapo"]
    options = NemoBAPOOptions.parse(laptop)
    assert options.flat() == load_config(REPO / "configs" / "local_cpu.yaml").loss_fn.bapo.model_dump()
    cluster = load_nemo_config(REPO / "configs" / "bapo_7b.yaml")["loss_fn"]["bapo"]
    path = tmp_path / "pasted.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load((REPO / "configs" / "local_cpu.yaml").read_text()),
                                    "loss_fn": {"bapo": cluster}}))
    pasted = load_config(path).loss_fn.bapo
    assert pasted.model_dump() == NemoBAPOOptions.parse(cluster).flat()
    assert (pasted.rho0, pasted.measure, pasted.ratio_reference) == (0.4, "gradient", "behavior")


def test_step_bounds_sample_is_one_key_of_the_block_and_only_the_exact_search_runs_here():
    """`step_bounds_sample` belongs to the shared block: NeMo-RL's side keeps the value it is given; the
    embedded step-wide search is always exact, so 1 loads here and any other value is refused in one line
    naming the key (never silently ignored)."""
    from bapo_nemo.algorithm.options import NemoBAPOOptions

    assert NemoBAPOOptions.parse({"granularity": "step", "step_bounds_sample": 0.5}).step_bounds_sample == 0.5
    local = REPO / "configs" / "local_cpu.yaml"
    assert load_config(local, ["loss_fn.bapo.step_bounds_sample=1"]).loss_fn.bapo.step_bounds_sample == 1.0
    with pytest.raises(RunConfigError) as refused:
        load_config(local, ["loss_fn.bapo.step_bounds_sample=0.5"])
    assert str(refused.value).splitlines()[1:] == [
        ("  loss_fn.bapo: step_bounds_sample=0.5 is for NeMo-RL runs (a sampled extra log-prob pass); the "
         "embedded trainer's step-wide search is always exact: set 1 or leave it out")
    ]


OLD_STYLE = """\
seed: 3
rollout:
  group_size: 4
  partial: {token_budget: 8, max_response_tokens: 40}
loss:
  bapo: {rho0: 0.5}
optim: {lr: 0.001, beta1: 0.8, beta2: 0.95}
train: {max_steps: 5, updates_per_batch: 2}
"""


NEW_STYLE = """\
grpo: {seed: 3, num_generations_per_prompt: 4, max_num_steps: 5}
partial_rollouts: {token_budget: 8, max_response_tokens: 40}
loss_fn:
  bapo: {rho0: 0.5}
policy:
  optimizer: {kwargs: {lr: 0.001, betas: [0.8, 0.95]}}
train: {updates_per_batch: 2}
"""
OLD_TO_NEW = (("seed", "grpo.seed"), ("rollout.group_size", "grpo.num_generations_per_prompt"),
              ("rollout.partial", "partial_rollouts"), ("loss.bapo", "loss_fn.bapo"),
              ("optim.lr", "policy.optimizer.kwargs.lr"), ("optim.beta1", "policy.optimizer.kwargs.betas"),
              ("optim.beta2", "policy.optimizer.kwargs.betas"), ("train.max_steps", "grpo.max_num_steps"))


def test_a_config_with_the_old_names_is_the_same_config_with_one_deprecation_warning_per_old_key(tmp_path):
    (tmp_path / "old.yaml").write_text(OLD_STYLE)
    (tmp_path / "new.yaml").write_text(NEW_STYLE)
    with pytest.warns(FutureWarning) as caught:
        old = load_config(tmp_path / "old.yaml")
    assert old.to_dict() == load_config(tmp_path / "new.yaml").to_dict()
    messages = [str(w.message) for w in caught]
    assert len(messages) == len(OLD_TO_NEW)
    for (old_key, new_key), message in zip(OLD_TO_NEW, messages):
        assert message.startswith(f"{tmp_path / 'old.yaml'}: {old_key}: renamed to {new_key}"), message
        assert "read until bapo-nemo 0.3" in message and "docs/embedded.md#config-keys" in message
    assert not any("updates_per_batch" in m for m in messages)  # kept its name


def test_an_old_override_key_sets_its_new_key_and_one_whose_value_changed_form_is_refused():
    with pytest.warns(FutureWarning, match=r"'train\.max_steps=3': train\.max_steps: renamed to grpo\.max_num_steps"):
        config = load_config(REPO / "configs" / "local_cpu.yaml", ["train.max_steps=3"])
    assert config.grpo.max_num_steps == 3
    with pytest.raises(RunConfigError, match=r"'optim\.beta1=0\.8'.*renamed to policy\.optimizer\.kwargs\.betas "
                                             r"\(a pair: \[beta1, beta2\]\)"):
        load_config(REPO / "configs" / "local_cpu.yaml", ["optim.beta1=0.8"])


def test_an_old_key_beside_its_new_key_is_an_error_naming_both(tmp_path):
    (tmp_path / "both.yaml").write_text("seed: 3\ngrpo: {seed: 4}\n")
    with pytest.raises(RunConfigError, match=r"seed and grpo\.seed are both set: .*keep grpo\.seed only"):
        load_config(tmp_path / "both.yaml")


def test_the_train_command_prints_each_deprecation_as_one_warning_line(tmp_path):
    """As a user runs it; runtime.device=cuda ends the command (no GPU here) right after the config is read."""
    (tmp_path / "old.yaml").write_text(OLD_STYLE)
    run = cli_process.run("train", "old.yaml", "runtime.device=cuda", cwd=tmp_path, env=cli_process.cli_env(),
                          timeout=HANG_GUARD_S)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and lines[-1].startswith("error: runtime.device=cuda but torch sees no CUDA GPU")
    warned = [line for line in lines if line.startswith("warning: old.yaml: ")]
    assert [line.split(": ")[2] for line in warned] == [old for old, _ in OLD_TO_NEW], run.stderr
    assert "Traceback" not in run.stderr and "FutureWarning" not in run.stderr


def test_a_checkpoint_written_with_the_old_names_resumes_under_the_new_ones():
    """A checkpoint's config.yaml from before the rename compares in today's names: the same settings give
    no difference; a changed one is named by its new key."""
    saved = yaml.safe_load(OLD_STYLE) | {"runtime": {"autocast": "bf16"}}
    same = load_config(None, ["grpo.seed=3", "grpo.num_generations_per_prompt=4",
                              "partial_rollouts.token_budget=8", "partial_rollouts.max_response_tokens=40",
                              "loss_fn.bapo.rho0=0.5", "policy.optimizer.kwargs.lr=0.001",
                              "policy.optimizer.kwargs.betas=[0.8,0.95]", "grpo.max_num_steps=5",
                              "policy.precision=bfloat16"]).to_dict()
    assert config_differences(saved, same) == []
    other = json.loads(json.dumps(same))
    other["policy"]["optimizer"]["kwargs"]["betas"] = [0.8, 0.99]
    assert config_differences(saved, other) == [
        "policy.optimizer.kwargs.betas: checkpoint=[0.8, 0.95], now=[0.8, 0.99]"
    ]
