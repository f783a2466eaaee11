"""The embedded run config's key names: every dotted key of the schema, close matches for a typo, and the
names the config had before it took NeMo-RL's (read through `upgrade` with a deprecation warning naming
the new key; refused beside their new key).

The table of every key and its NeMo-RL counterpart is in docs/embedded.md ("Config keys").
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel

# Old key (or section) -> the key it became. A key under an old section moves with it
# (rollout.partial.token_budget -> partial_rollouts.token_budget).
RENAMED: dict[str, str] = {
    "seed": "grpo.seed",
    "rollout.group_size": "grpo.num_generations_per_prompt",
    "rollout.prompts_per_step": "grpo.num_prompts_per_step",
    "train.max_steps": "grpo.max_num_steps",
    "eval.every": "grpo.val_period",
    "model.pretrained": "policy.model_name",
    "runtime.autocast": "policy.precision",
    "train.micro_batch_size": "policy.train_micro_batch_size",
    "train.gradient_checkpointing": "policy.dtensor_cfg.activation_checkpointing",
    "optim.lr": "policy.optimizer.kwargs.lr",
    "optim.weight_decay": "policy.optimizer.kwargs.weight_decay",
    "optim.beta1": "policy.optimizer.kwargs.betas",
    "optim.beta2": "policy.optimizer.kwargs.betas",
    "optim.grad_clip": "policy.max_grad_norm",
    "rollout.temperature": "policy.generation.temperature",
    "loss.bapo": "loss_fn.bapo",
    "loss.ratio_reference": "loss_fn.bapo.ratio_reference",
    "loss.behavior_weight_cap": "loss_fn.truncated_importance_sampling_ratio",
    "rollout.partial": "partial_rollouts",
    "data.train_path": "data.train.data_path",
    "data.split": "data.train.split",
    "data.eval_path": "data.validation.data_path",
    "data.eval_split": "data.validation.split",
    "data.prompt_field": "data.default.input_key",
    "data.answer_field": "data.default.output_key",
    "checkpoint.every": "checkpointing.save_period",
    "checkpoint.keep_last": "checkpointing.keep_top_k",
    "tracking.tracking_uri": "logger.mlflow.tracking_uri",
    "tracking.experiment_name": "logger.mlflow.experiment_name",
    "tracking.run_name": "logger.mlflow.run_name",
}
# Old sections with no key left: named when they appear empty.
_GONE_SECTIONS = {"rollout", "optim", "checkpoint"}
# Values that changed form with their key.
_PRECISION = {"none": "float32", "bf16": "bfloat16"}
_HOW = {
    "runtime.autocast": " (none -> float32, bf16 -> bfloat16)",
    "optim.beta1": " (a pair: [beta1, beta2])",
    "optim.beta2": " (a pair: [beta1, beta2])",
}


# ---- the schema's keys ---------------------------------------------------------------------------------
def all_keys(schema: type[BaseModel]) -> list[str]:
    """Every dotted key of `schema`, sections and leaves."""
    out: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            out.append(prefix + name)
            sub = _submodel(field.annotation)
            if sub is not None:
                walk(sub, prefix + name + ".")

    walk(schema, "")
    return out


def _submodel(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def schema_has(schema: type[BaseModel], parts: list[str]) -> bool:
    model: type[BaseModel] | None = schema
    for p in parts:
        if model is None or p not in model.model_fields:
            return False
        model = _submodel(model.model_fields[p].annotation)
    return True


def did_you_mean(schema: type[BaseModel], key: str) -> str:
    """Close matches among all schema keys: by full dotted path, then by the last component."""
    keys = all_keys(schema)
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
    moved = list(dict.fromkeys(new for old, new in RENAMED.items() if old.startswith(f"{section}.")))
    if not close and moved:
        return f"; did you mean one of: {', '.join(moved)} (where the {section} section's keys went)?"
    if not close and siblings:
        return f"; did you mean one of: {', '.join(siblings)}?"
    if not close:
        return f"; valid sections: {', '.join(schema.model_fields)}"
    return f"; did you mean: {', '.join(close)}?"


# ---- the old names -------------------------------------------------------------------------------------
def new_name(key: str) -> str | None:
    """The key an old dotted key became (None: it is not an old name)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in RENAMED:
            return ".".join([RENAMED[prefix], *parts[n:]])
    return None


def old_name(key: str) -> str:
    """The name a key had before (itself when it kept its name): the inverse of `new_name`."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        olds = [old for old, new in RENAMED.items() if new == ".".join(parts[:n])]
        if len(olds) == 1:
            return ".".join([olds[0], *parts[n:]])
    return key


def renamed_message(key: str) -> str | None:
    """`old.key: renamed to new.key (...)`, or None when `key` is not an old name."""
    new = new_name(key)
    if new is None:
        return None
    return f"{key}: renamed to {new}{_HOW.get(key, '')}"


DOCS = "NeMo-RL's names where a key means the same there; every key: docs/embedded.md#config-keys"


def renamed_one_to_one(key: str) -> bool:
    """Whether old `key` became a new key with the same value (not a pair or a new vocabulary of values)."""
    return new_name(key) is not None and key not in _HOW


def set_twice(data: dict) -> list[str]:
    """Lines naming each old key set beside the new key it became (which of the two counts is not ours to pick)."""
    lines = []
    for key in _paths(data):
        new = new_name(key)
        if new is not None and _has(data, new):
            lines.append(f"{key} and {new} are both set: {key} is {new}'s old name; keep {new} only")
    return lines


def _has(data: dict, key: str) -> bool:
    try:
        _get(data, key)
    except (KeyError, TypeError):
        return False
    return True


def old_keys(data: dict) -> list[str]:
    """The old names used in a config dict, as pointer lines (empty: none)."""
    lines = []
    for key in _paths(data):
        message = renamed_message(key)
        if message is None and key in _GONE_SECTIONS:
            message = f"{key}: this section's keys moved (see docs/embedded.md#config-keys)"
        if message is not None and message not in lines:
            lines.append(message)
    return lines


def _paths(data: dict, prefix: str = "") -> list[str]:
    """Dotted paths of `data`: leaves and empty sections, each as deep as it goes; a path that is an old name
    stops there (its keys moved with it)."""
    out = []
    for k, v in data.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v and path not in RENAMED:
            out += _paths(v, path + ".")
        else:
            out.append(path)
    return out


def upgrade(data: dict) -> dict:
    """A config dict written with the old names, in today's names (keys that are not old names untouched)."""
    out: dict[str, Any] = {}
    betas = [0.9, 0.99]
    for key in _paths(data):
        value = _get(data, key)
        new = new_name(key)
        if key in ("optim.beta1", "optim.beta2"):
            betas[key == "optim.beta2"] = value
            _set(out, new, betas)
        elif key == "runtime.autocast":
            _set(out, new, _PRECISION.get(value, value))
        else:
            _set(out, new or key, value)
    return out


def _get(data: dict, key: str) -> Any:
    for p in key.split("."):
        data = data[p]
    return data


def _set(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    if isinstance(value, dict) and isinstance(data.get(leaf), dict):
        data[leaf].update(value)
    else:
        data[leaf] = value
