"""The embedded trainer's run config: one pydantic schema (extra keys forbidden), loaded from YAML, with
dotted command-line overrides (`loss.bapo.rho0=0.5`) checked against the schema.

Loss presets for experiments are plain settings of the `loss.bapo` block:
  fixed clip [0.8, 1.2]     loss.bapo: {enabled: false, c_low_min: 0.8, c_high_min: 1.2}
  clip-higher [0.8, 1.28]   loss.bapo: {enabled: false, c_low_min: 0.8, c_high_min: 1.28}
  BAPO                      loss.bapo: {enabled: true, ...paper grids...}
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bapo_nemo.algorithm import BAPOConfig
from bapo_nemo.config_errors import validation_lines
from bapo_nemo.rollout import PartialRolloutConfig


class RunConfigError(ValueError):
    """The run config is invalid; the message names the key (and the file) and how to fix it."""


class _Section(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `.nan` is a typo to report, never a value to train with
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RuntimeConfig(_Section):
    num_threads: int = Field(
        1,
        ge=1,
        description="torch intra-op threads. 1 is fastest for the tiny model "
        "on a shared machine (more threads spin-wait on busy cores).",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu, or cuda for one GPU.")
    autocast: Literal["none", "bf16"] = Field(
        "none",
        description="bf16: every model forward runs under torch.autocast(bfloat16) (log-probs in fp32).",
    )
    progress: bool = Field(True, description="Show a progress bar.")


class ModelConfig(_Section):
    """A tiny Qwen2 built from a config (`Qwen2Config` + `Qwen2ForCausalLM`), or, with `pretrained`, any
    causal LM and its tokenizer (`AutoModelForCausalLM` / `AutoTokenizer`; the size keys are then unused)."""

    pretrained: str | None = Field(
        None,
        description="Local HF model directory or hub id (hub ids need the network); null: the tiny Qwen2.",
    )
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
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        return self


class TaskConfig(_Section):
    """Bundled multi-step arithmetic (generated with a seed) or tasks from JSONL files."""

    train_file: str | None = Field(
        None, description="JSONL of {question, answer[, solution]}; null: generate."
    )
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


class DataConfig(_Section):
    """Your own prompts and reference answers from local Hugging Face `datasets` files (parquet, JSON/JSONL,
    CSV, arrow, or a directory); used instead of `task` when `train_path` is set."""

    train_path: str | None = Field(None, description="Training prompts; null: the `task` section's tasks.")
    eval_path: str | None = Field(
        None, description="Held-out prompts; null: hold out eval_size training rows."
    )
    split: str = Field("train", description="Split of train_path to read (sources with several splits).")
    eval_split: str = Field("train", description="Split of eval_path to read.")
    prompt_field: str = Field("question", description="Column holding the prompt.")
    answer_field: str = Field("answer", description="Column holding the reference answer.")
    solution_field: str | None = Field(None, description="Column with reference solutions (for the warm-up).")
    prompt_template: str = Field("{prompt}", description='Each prompt is this text with "{prompt}" replaced.')
    eval_size: int = Field(64, ge=1, description="Rows held out from train_path when eval_path is null.")
    reward: Literal["math_verify", "arithmetic"] = Field(
        "math_verify", description="math_verify: NeMo-RL's math grading. arithmetic: exact text after '#'."
    )
    overlong_prompts: Literal["skip", "truncate"] = Field(
        "skip",
        description="Prompts longer than the context window minus rollout.partial.max_response_tokens: "
        "skip them (counted in a warning) or keep their last tokens.",
    )
    max_bad_fraction: float = Field(0.1, ge=0, le=1, description="Most malformed rows tolerated.")

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
    step_error_rate: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Generated demonstrations: probability that a step's result is off by "
        "1-2 (the chain continues from it). Imperfect demonstrations leave errors for RL to remove.",
    )
    loop_rate: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Generated demonstrations: probability that one gets stuck repeating a step until "
        "rollout.partial.max_response_tokens, with no answer. Failing rollouts then run long, as wrong "
        "long chain-of-thought answers do: negative tokens outnumber positive ones.",
    )


class RolloutConfig(_Section):
    group_size: int = Field(8, ge=2, description="Samples per prompt (GRPO group).")
    prompts_per_step: int = Field(8, ge=1, description="Complete prompt groups trained on per step.")
    temperature: float = Field(1.0, gt=0)
    partial: PartialRolloutConfig = Field(
        default_factory=lambda: PartialRolloutConfig(
            token_budget=32, max_resumptions=4, max_response_tokens=112, max_in_flight_groups=16
        ),
        description="Partial rollouts (bapo_nemo.rollout). token_budget >= max_response_tokens disables "
        "them; max_in_flight_groups (default 2 x prompts_per_step) bounds the prompts started ahead.",
    )

    @model_validator(mode="after")
    def _in_flight_fits(self) -> RolloutConfig:
        in_flight = self.partial.max_in_flight_groups
        if in_flight is not None and in_flight < self.prompts_per_step:
            raise ValueError(
                f"partial.max_in_flight_groups={in_flight} must be >= prompts_per_step={self.prompts_per_step}"
            )
        if self.partial.max_response_tokens is None:
            raise ValueError("partial.max_response_tokens must be set (the model has a fixed context length)")
        return self


class ReplayConfig(_Section):
    """Cross-step sample replay (`bapo_nemo.rollout.ReplayBuffer`)."""

    groups_per_step: int = Field(0, ge=0, description="Replayed groups added to each step's batch (0: off).")
    capacity: int = Field(64, ge=1)
    max_staleness: int = Field(4, ge=0, description="In optimizer updates.")


class LossConfig(_Section):
    bapo: BAPOConfig = Field(default_factory=BAPOConfig)
    ratio_reference: Literal["behavior", "proximal"] = Field(
        "behavior",
        description="behavior: r = pi_theta / pi_gen (generation log-probs). proximal: r = pi_theta / "
        "pi_prox, pi_prox recomputed at the start of each rollout batch, and the behaviour gap "
        "pi_prox / pi_gen applied as a truncated importance weight (NeMo-RL's split).",
    )
    behavior_weight_cap: float = Field(2.0, gt=0, description="proximal only: truncation of pi_prox/pi_gen.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus (the paper uses none).")


class OptimConfig(_Section):
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")


class TrainConfig(_Section):
    max_steps: int = Field(60, ge=0, description="RL steps (rollout batches).")
    updates_per_batch: int = Field(2, ge=1, description="Optimizer updates per rollout batch (staleness).")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward/backward (length-sorted).")
    step_search_graph_tokens: int = Field(
        65536,
        ge=0,
        description="bapo.granularity=step: up to this many tokens in a mini-batch, keep the micro-batches' "
        "autograd graphs until the bounds are known instead of running an extra no-grad forward (0: never).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (less memory, ~30% more compute)."
    )


class EvalConfig(_Section):
    every: int = Field(10, ge=1, description="Held-out evaluation every N steps (and at start and end).")
    k: int = Field(4, ge=1, description="Samples per held-out prompt: avg@k and pass@k.")


class CheckpointConfig(_Section):
    every: int = Field(10, ge=1)
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept (older ones are deleted).")


class TrackingConfig(_Section):
    tracking_uri: str | None = Field(None, description="null: sqlite:///<output_dir>/mlflow.db")
    experiment_name: str = "bapo-embedded"
    run_name: str | None = None
    samples_every: int = Field(10, ge=1, description="Log a table of sample generations every N steps.")
    num_samples: int = Field(8, ge=1)


class RunConfig(_Section):
    seed: int = 0
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _lengths_fit_the_model(self) -> RunConfig:
        if self.model.pretrained is not None or self.data.train_path is not None:
            return self  # checked at set-up against the model's context window and the tokenized prompts
        longest_prompt = 2 + (2 + 1) * self.task.max_ops + 2  # BOS + "dd" + ("+d") * ops + "?" (generous)
        need = longest_prompt + self.rollout.partial.max_response_tokens
        if need > self.model.max_position_embeddings:
            raise ValueError(
                f"rollout.partial.max_response_tokens={self.rollout.partial.max_response_tokens} plus the longest "
                f"prompt (~{longest_prompt} tokens) exceeds model.max_position_embeddings="
                f"{self.model.max_position_embeddings}: lower the former or raise the latter"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# Keys that may differ between a checkpoint and the resumed run: they change how long or how visibly the
# run goes, not what it computes.
RESUME_HARMLESS_KEYS = (
    "train.max_steps",
    "checkpoint.",
    "eval.every",
    "tracking.",
    "runtime.",
)


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
            raise RunConfigError(f"{path}: the top level must be a mapping of sections (model:, loss:, ...)")
    # Defaults first, so a YAML file or an override may set one key of a block whose other keys are
    # required by its own schema (e.g. rollout.partial.max_response_tokens alone).
    data = _deep_merge(RunConfig().to_dict(), data)
    for item in overrides or []:
        apply_override(data, item)
    return validate_config(data, where)


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def validate_config(data: dict, where: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines = validation_lines(exc, unknown_key=lambda key: "unknown key" + _did_you_mean(key))
        raise RunConfigError(f"invalid run config {where}:\n  " + "\n  ".join(lines)) from None


def apply_override(data: dict, item: str) -> None:
    """Apply one `a.b.c=value` override (value parsed as YAML) after checking the key exists."""
    if "=" not in item:
        raise RunConfigError(f"override {item!r} must look like key.sub=value (e.g. loss.bapo.rho0=0.5)")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not _schema_has(parts):
        raise RunConfigError(f"unknown config key {key!r} in override {item!r}" + _did_you_mean(key))
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


def all_keys() -> list[str]:
    """Every dotted key of the schema, leaves and sections."""
    out: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            out.append(prefix + name)
            sub = _submodel(field.annotation)
            if sub is not None:
                walk(sub, prefix + name + ".")

    walk(RunConfig, "")
    return out


def _submodel(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _schema_has(parts: list[str]) -> bool:
    model: type[BaseModel] | None = RunConfig
    for i, p in enumerate(parts):
        if model is None or p not in model.model_fields:
            return False
        model = _submodel(model.model_fields[p].annotation)
    return True


def _did_you_mean(key: str) -> str:
    """Close matches among all schema keys: by full dotted path, then by the last component."""
    keys = all_keys()
    leaf = key.rsplit(".", 1)[-1]
    leaves: dict[str, list[str]] = {}
    for k in keys:
        leaves.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    for near_leaf in difflib.get_close_matches(leaf, list(leaves), n=3, cutoff=0.7):
        close += leaves[near_leaf]
    close = list(dict.fromkeys(close))[:5]
    section = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = [
        k for k in keys if section and k.startswith(section + ".") and "." not in k[len(section) + 1 :]
    ]
    if not close and siblings:
        return f"; did you mean one of: {', '.join(siblings)}?"
    if not close:
        return f"; valid sections: {', '.join(RunConfig.model_fields)}"
    return f"; did you mean: {', '.join(close)}?"


# ---- comparing a checkpoint's config with this run's -----------------------------------------------------
def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ (ignoring RESUME_HARMLESS_KEYS), as `key: checkpoint=X, now=Y`.

    The checkpoint's config is first read through today's schema, so a key added since it was written
    (absent there) compares as its default: a code update between two requeues does not block resume
    unless the run sets that key to something else.
    """
    try:
        saved = RunConfig.model_validate(saved).to_dict()
    except ValidationError:
        pass  # a key was removed or renamed since: compare as written, the message names it
    a, b = flatten(saved), flatten(current)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if any(key == h or (h.endswith(".") and key.startswith(h)) for h in RESUME_HARMLESS_KEYS):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append(f"{key}: checkpoint={a.get(key, '<absent>')!r}, now={b.get(key, '<absent>')!r}")
    return diffs
