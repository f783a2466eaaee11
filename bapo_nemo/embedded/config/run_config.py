"""The embedded trainer's run config: one pydantic schema (extra keys forbidden), loaded from YAML, with
dotted command-line overrides (`loss_fn.bapo.rho0=0.5`) checked against it. A key that means what a
NeMo-RL v0.7.0 key means has that key's name and place (docs/embedded.md#config-keys maps them all); the
old names are read with a deprecation warning naming the new key (`key_names.py`). The loss presets
(fixed clip, clip-higher, BAPO) are settings of `loss_fn.bapo` (docs/embedded.md, "Loss presets").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bapo_nemo.algorithm.options import BAPOBlock
from bapo_nemo.config_errors import validation_lines
from bapo_nemo.config_kind import wrong_tool_for_nemo_rl
from bapo_nemo.embedded.config import key_names as config_keys
from bapo_nemo.rollout import PartialRolloutConfig


class RunConfigError(ValueError):
    """The run config is invalid; the message names the key (and the file) and how to fix it."""


class _Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `.nan` is a typo to report, never a value to train with
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RuntimeConfig(_Section):
    num_threads: int = Field(1, ge=1, description="torch intra-op threads. 1 is fastest for the tiny model "
                             "on a shared machine (more threads spin-wait on busy cores).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu, or cuda for one GPU.")
    progress: bool = Field(True, description="Show a progress bar.")


class GRPOConfig(_Section):
    """NeMo-RL's `grpo` keys the embedded loop has."""

    seed: int = 0
    max_num_steps: int = Field(60, ge=0, description="RL steps (rollout batches).")
    num_prompts_per_step: int = Field(8, ge=1, description="Complete prompt groups trained on per step.")
    num_generations_per_prompt: int = Field(8, ge=2, description="Samples per prompt (GRPO group).")
    val_period: int = Field(10, ge=1, description="Held-out evaluation every N steps (and at start and end).")


class DTensorConfig(_Section):
    activation_checkpointing: bool = Field(False, description="Recompute activations in the backward pass "
                                           "(less memory, ~30% more compute).")


class AdamWKwargs(_Section):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.99)


class OptimizerConfig(_Section):
    """torch.optim.AdamW (NeMo-RL's `policy.optimizer: {name: torch.optim.AdamW, kwargs: ...}`)."""

    kwargs: AdamWKwargs = Field(default_factory=AdamWKwargs)


class GenerationConfig(_Section):
    temperature: float = Field(1.0, gt=0)


class PolicyConfig(_Section):
    """NeMo-RL's `policy` keys the embedded trainer has."""

    model_name: str | None = Field(
        None,
        description="Any causal LM and its tokenizer (AutoModelForCausalLM / AutoTokenizer): a local HF "
        "model directory or a hub id (hub ids need the network); null: the tiny Qwen2 of `model`.",
    )
    precision: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="bfloat16: every model forward runs under torch.autocast(bfloat16) (weights stay in "
        "model.dtype, log-probs and the loss in fp32).",
    )
    train_micro_batch_size: int = Field(32, ge=1, description="Most sequences per forward/backward (sorted).")
    max_grad_norm: float = Field(1.0, gt=0, description="Max global grad norm.")
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)


class ModelConfig(_Section):
    """The weights' dtype, and the size of the tiny Qwen2 built from a config (`Qwen2Config` +
    `Qwen2ForCausalLM`) when `policy.model_name` is null (the size keys are then used)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype.")
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(256, ge=16)
    rope_theta: float = 10000.0

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        h, heads, kv = self.hidden_size, self.num_heads, self.num_kv_heads
        if h % heads:
            raise ValueError(f"hidden_size={h} must be a multiple of num_heads={heads}")
        if heads % kv:
            raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv}")
        return self


class TaskConfig(_Section):
    """Bundled multi-step arithmetic (generated with a seed) or tasks from JSONL files."""

    train_file: str | None = Field(None, description="JSONL: {question, answer[, solution]}; null: generated")
    eval_file: str | None = Field(None, description="JSONL held-out set; null: generate eval_size tasks.")
    min_ops: int = Field(1, ge=1, description="Fewest operations (steps) per generated task.")
    max_ops: int = Field(12, ge=1, description="Most operations per generated task.")
    tail_alpha: float = Field(1.5, gt=0, description="P(n ops) ~ n^-tail_alpha: smaller = heavier tail.")
    max_value: int = Field(99, ge=9, description="Intermediate values stay in [0, max_value].")
    max_operand: int = Field(9, ge=1, le=9)
    eval_size: int = Field(64, ge=1, description="Generated held-out tasks (ignored with eval_file).")
    eval_seed: int = Field(1_000_003, description="Seed of the held-out set (independent of the run seed).")
    max_bad_fraction: float = Field(0.1, ge=0, le=1, description="JSONL: most malformed rows tolerated.")

    @model_validator(mode="after")
    def _ops_range(self) -> TaskConfig:
        if self.min_ops > self.max_ops:
            raise ValueError(f"min_ops={self.min_ops} must be <= max_ops={self.max_ops}")
        return self


class DatasetConfig(_Section):
    data_path: str | None = Field(None, description="A .parquet/.json/.jsonl/.csv/.arrow file or directory.")
    split: str = Field("train", description="Split to read (sources with several splits).")


class ColumnsConfig(_Section):
    input_key: str | None = Field(None, description="Prompt column; null: question, or prompt (TRL's name).")
    output_key: str = Field("answer", description="Column holding the reference answer.")


class DataConfig(_Section):
    """Your own prompts and reference answers from local Hugging Face `datasets` files; used instead of
    `task` when `train.data_path` is set."""

    train: DatasetConfig = Field(
        default_factory=DatasetConfig, description="Training prompts; data_path null: the `task` section's."
    )
    validation: DatasetConfig = Field(
        default_factory=DatasetConfig, description="Held-out prompts; data_path null: eval_size rows of train"
    )
    default: ColumnsConfig = Field(default_factory=ColumnsConfig, description="Columns of both sources.")
    solution_field: str | None = Field(None, description="Column with reference solutions (for the warm-up).")
    prompt_template: str = Field("{prompt}", description='Each prompt is this text with "{prompt}" replaced.')
    eval_size: int = Field(64, ge=1, description="Rows held out from train without validation.data_path.")
    reward: str = Field(
        "math_verify",
        description="math_verify: NeMo-RL's math grading. arithmetic: exact text after '#'. module:function: "
        "your own, called as TRL's reward_funcs (bapo_nemo/embedded/data/rewards.py).",
    )
    overlong_prompts: Literal["skip", "truncate"] = Field(
        "skip",
        description="Prompts longer than the context window minus partial_rollouts.max_response_tokens: "
        "skip them (counted in a warning) or keep their last tokens.",
    )
    max_bad_fraction: float = Field(0.1, ge=0, le=1, description="Most malformed rows tolerated.")

    @field_validator("reward")
    @classmethod
    def _reward_named(cls, v: str) -> str:
        if not re.fullmatch(r"math_verify|arithmetic|[A-Za-z_][\w.]*:[A-Za-z_]\w*", v):
            raise ValueError(f"{v!r} is not a reward: use math_verify, arithmetic or module:function")
        return v

    @field_validator("prompt_template", mode="before")
    @classmethod
    def _template_holds_the_prompt(cls, value):
        if isinstance(value, dict):  # `prompt_template: {prompt}` unquoted is a YAML flow mapping
            # pydantic reports only ValueError as a validation error, hence not TypeError
            raise ValueError("YAML read this value as a mapping (an unquoted {prompt} is one): quote it, "  # noqa: TRY004
                             'e.g. prompt_template: "{prompt}"')
        if isinstance(value, str) and "{prompt}" not in value:
            raise ValueError(f"{value!r} has no {{prompt}}, so every prompt would be this same text: put "
                             "{prompt} where the question goes")
        return value


class WarmupConfig(_Section):
    """Supervised warm-up on reference solutions, so RL starts with signal. Cached in <output_dir>/warmup."""

    steps: int = Field(300, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    step_error_rate: float = Field(0.0, ge=0, lt=1, description="Generated demonstrations: probability "
                                   "that a step's result is off by 1-2 (the chain continues from it). "
                                   "Imperfect demonstrations leave errors for RL to remove.")
    loop_rate: float = Field(0.0, ge=0, lt=1, description="Generated demonstrations: probability that one "
                             "gets stuck repeating a step until partial_rollouts.max_response_tokens, with "
                             "no answer. Failing rollouts then run long, as wrong long chain-of-thought "
                             "answers do: negative tokens outnumber positive ones.")


class ReplayConfig(_Section):
    """Cross-step sample replay (`bapo_nemo.rollout.ReplayBuffer`)."""

    groups_per_step: int = Field(0, ge=0, description="Replayed groups added to each step's batch (0: off).")
    capacity: int = Field(64, ge=1)
    max_staleness: int = Field(4, ge=0, description="In optimizer updates.")


class LossFnConfig(_Section):
    bapo: BAPOBlock = Field(default_factory=BAPOBlock, description="The same block as a NeMo-RL config's.")
    truncated_importance_sampling_ratio: float = Field(
        2.0, gt=0, description="bapo.ratio_reference=proximal: cap of the importance weight pi_prox / pi_gen."
    )

    @field_validator("bapo")
    @classmethod
    def _step_search_exact(cls, bapo: BAPOBlock) -> BAPOBlock:
        # Refused rather than ignored: a sampled search here would not be the one the value asks for.
        if bapo.step_bounds_sample != 1:
            raise ValueError(
                f"step_bounds_sample={bapo.step_bounds_sample:g} is for NeMo-RL runs (a sampled extra log-prob "
                "pass); the embedded trainer's step-wide search is always exact: set 1 or leave it out"
            )
        return bapo


class LossConfig(_Section):
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus (the paper uses none).")


class TrainConfig(_Section):
    updates_per_batch: int = Field(2, ge=1, description="Optimizer updates per rollout batch (staleness).")
    step_search_graph_tokens: int = Field(
        65536, ge=0, description="bapo.granularity=step: up to this many tokens in a mini-batch, keep the "
        "micro-batches' autograd graphs until the bounds are known, not an extra no-grad forward (0: never).",
    )


class EvalConfig(_Section):
    k: int = Field(4, ge=1, description="Samples per held-out prompt: avg@k and pass@k.")


class CheckpointingConfig(_Section):
    save_period: int = Field(10, ge=1, description="Checkpoint every N steps (and at the end and on a stop).")
    keep_top_k: int = Field(2, ge=1, description="The newest complete checkpoints kept (older ones deleted).")


class MlflowConfig(_Section):
    tracking_uri: str | None = Field(None, description="null: sqlite:///<output_dir>/mlflow.db")
    experiment_name: str = "bapo-embedded"
    run_name: str | None = Field(None, description="null: the output directory's name.")


class LoggerConfig(_Section):
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)


class TrackingConfig(_Section):
    samples_every: int = Field(10, ge=1, description="Log a table of sample generations every N steps.")
    num_samples: int = Field(8, ge=1)


class RunConfig(_Section):
    """NeMo-RL's sections and names where a key means the same as there (docs/embedded.md#config-keys),
    then the embedded trainer's own sections."""

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    loss_fn: LossFnConfig = Field(default_factory=LossFnConfig)
    partial_rollouts: PartialRolloutConfig = Field(
        default_factory=lambda: PartialRolloutConfig(
            token_budget=32, max_resumptions=4, max_response_tokens=112, max_in_flight_groups=16
        ),
        description="Partial rollouts (bapo_nemo.rollout), the same block as a NeMo-RL config's. "
        "token_budget >= max_response_tokens disables them; max_in_flight_groups (default 2 x "
        "grpo.num_prompts_per_step) bounds the prompts started ahead.",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _rollouts_fit(self) -> RunConfig:
        partial, per_step = self.partial_rollouts, self.grpo.num_prompts_per_step
        if partial.max_in_flight_groups is not None and partial.max_in_flight_groups < per_step:
            raise ValueError(
                f"partial_rollouts.max_in_flight_groups={partial.max_in_flight_groups} must be >= "
                f"grpo.num_prompts_per_step={per_step}"
            )
        if partial.max_response_tokens is None:
            raise ValueError(
                "partial_rollouts.max_response_tokens must be set (the model has a fixed context length)"
            )
        if self.policy.model_name is not None or self.data.train.data_path is not None:
            return self  # checked at set-up against the model's context window and the tokenized prompts
        longest_prompt = 2 + (2 + 1) * self.task.max_ops + 2  # BOS + "dd" + ("+d") * ops + "?" (generous)
        window, tokens = self.model.max_position_embeddings, partial.max_response_tokens
        if longest_prompt + tokens > window:
            lower = (f"set partial_rollouts.max_response_tokens={window - longest_prompt} or lower, or "
                     if window > longest_prompt else "")
            raise ValueError(
                f"partial_rollouts.max_response_tokens={tokens} plus the longest prompt (~{longest_prompt} "
                f"tokens) exceeds model.max_position_embeddings={window}: {lower}set "
                f"model.max_position_embeddings={longest_prompt + tokens} or higher"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# Keys that change only what the console shows, never what a run computes: they are not run parameters
# (MLflow params, the config hash), so resuming with --no-progress continues the same run without a word.
DISPLAY_ONLY_KEYS = (("runtime", "progress"),)


def run_params(config_dict: dict[str, Any]) -> dict[str, Any]:
    """`config_dict` without DISPLAY_ONLY_KEYS: what a run logs as its parameters."""
    params = {section: dict(values) if isinstance(values, dict) else values for section, values in config_dict.items()}
    for section, key in DISPLAY_ONLY_KEYS:
        params.get(section, {}).pop(key, None)
    return params


# ---- loading -------------------------------------------------------------------------------------------
def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML run config (None: all defaults), apply `key.sub=value` overrides, validate."""
    where = str(path) if path is not None else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise RunConfigError(f"config {path} is a directory: pass a YAML file (e.g. configs/local_cpu.yaml)")
        if path.exists() and not path.is_file():  # a FIFO or a device: reading it could block or never end
            raise RunConfigError(f"config {path} is not a regular file: write the config to a YAML file and pass "
                                 "that (e.g. configs/local_cpu.yaml)")
        if not path.is_file():
            raise RunConfigError(f"config file {path} does not exist (e.g. configs/local_cpu.yaml)")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise RunConfigError(f"{path}: not valid YAML: {exc}") from None
        if data is None or data == {}:
            # the built-in defaults are not configs/local_cpu.yaml's; an empty file is a mistake, not a choice
            raise RunConfigError(
                f"{path} is empty: start from a shipped config (cp configs/local_cpu.yaml {path}) and edit it"
            )
        if not isinstance(data, dict):
            raise RunConfigError(f"{path}: the top level must be a mapping of sections (grpo:, policy:, ...)")
        if (wrong_tool := wrong_tool_for_nemo_rl(str(path), data)) is not None:
            raise RunConfigError(wrong_tool)
        data = _accept_old_names(data, str(path))
    # Defaults first, so a YAML file or an override may set one key of a block whose other keys are
    # required by its own schema (e.g. partial_rollouts.max_response_tokens alone).
    data = deep_merge(RunConfig().to_dict(), data)
    for item in overrides or []:
        apply_override(data, item)
    return validate_config(data, where)


OLD_NAMES_UNTIL = "0.3"  # the release that stops reading the names the config had before NeMo-RL's


def _accept_old_names(data: dict, where: str) -> dict:
    """`data` in today's names, one deprecation warning per old key; an old key beside its new one is an error."""
    clashes = config_keys.set_twice(data)
    if clashes:
        raise RunConfigError(f"invalid run config {where}:\n  " + "\n  ".join(clashes))
    for line in config_keys.old_keys(data):
        _deprecated(f"{where}: {line}")
    return config_keys.upgrade(data)


def _deprecated(message: str) -> None:
    import warnings

    warnings.warn(f"{message}; the old name is read until bapo-nemo {OLD_NAMES_UNTIL} ({config_keys.DOCS})",
                  FutureWarning, stacklevel=3)


def deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def validate_config(data: dict, where: str = "<config>") -> RunConfig:
    renamed = config_keys.old_keys(data)
    if renamed:
        lines = [*renamed, f"({config_keys.DOCS})"]
        raise RunConfigError(f"invalid run config {where}:\n  " + "\n  ".join(lines))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines = validation_lines(
            exc, unknown_key=lambda key: "unknown key" + config_keys.did_you_mean(RunConfig, key)
        )
        raise RunConfigError(f"invalid run config {where}:\n  " + "\n  ".join(lines)) from None


def apply_override(data: dict, item: str) -> None:
    """Apply one `a.b.c=value` override (value parsed as YAML) after checking the key exists."""
    if "=" not in item:
        raise RunConfigError(f"override {item!r} must look like key.sub=value (e.g. loss_fn.bapo.rho0=0.5)")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not config_keys.schema_has(RunConfig, parts) and config_keys.renamed_one_to_one(key):
        _deprecated(f"override {item!r}: {config_keys.renamed_message(key)}")
        key, parts = config_keys.new_name(key), config_keys.new_name(key).split(".")
    if not config_keys.schema_has(RunConfig, parts):
        renamed = config_keys.renamed_message(key)
        if renamed is not None:  # a value that changed form with its key: the new key, written in its form
            raise RunConfigError(f"override {item!r}: {renamed} ({config_keys.DOCS})")
        raise RunConfigError(
            f"unknown config key {key!r} in override {item!r}" + config_keys.did_you_mean(RunConfig, key)
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value
