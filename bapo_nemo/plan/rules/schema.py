"""Key checking against the config schema of the NeMo-RL the job will run, without nemo_rl installed.

`SCHEMAS` names the key lists: one shipped per tested tree (`nemo_rl_v070_keys.json`,
`nemo_rl_main_keys.json`, made by nemo_rl_keys.py) and `installed`. A key outside its list is almost always
a typo or another release's key, which NeMo-RL would silently ignore or fail on hours in. Free-form
sections (dataset, environment, vLLM/HF kwargs, env vars) and our own blocks are not checked.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

# Sections whose contents NeMo-RL passes through or validates elsewhere.
OPEN_SECTIONS = (
    "env",
    "data.train",
    "data.validation",
    "data.default",
    "policy.hf_config_overrides",
    "policy.generation.vllm_kwargs",
    "policy.dtensor_cfg.automodel_kwargs",
    "policy.tokenizer.chat_template_kwargs",
    "logger.wandb",
    "logger.swanlab",
    "logger.tensorboard",
    "on_policy_distillation",
    "policy.generation.vllm_cfg.http_server_serving_chat_kwargs",
)
# Blocks of ours: `loss_fn.bapo` (NemoBAPOOptions) and `partial_rollouts` (PartialRolloutConfig).
OWN_SECTIONS = ("loss_fn.bapo", "partial_rollouts")


# `--nemo-rl` values: the shipped list of each tested tree, or the installed NeMo-RL's own keys.
SCHEMAS = {"v0.7.0": "nemo_rl_v070_keys.json", "main": "nemo_rl_main_keys.json", "installed": None}
DEFAULT_SCHEMA = "v0.7.0"  # the release the container (nvcr.io/nvidia/nemo-rl:v0.7.0) ships


@dataclass(frozen=True)
class UnknownKey:
    path: str
    suggestion: str | None
    schema: str = DEFAULT_SCHEMA
    elsewhere: tuple[str, ...] = ()  # the other schemas that know this key

    def message(self) -> str:
        """The reason, without the path: findings carry the key separately and print `key: message`."""
        label = "the installed NeMo-RL's" if self.schema == "installed" else f"a NeMo-RL {self.schema}"
        if self.elsewhere:
            return (
                f"not {label} config key: it is NeMo-RL {' and '.join(self.elsewhere)}'s (check against the "
                f"NeMo-RL the job runs: --nemo-rl {self.elsewhere[0]}, or remove it)"
            )
        hint = f"did you mean {self.suggestion}?" if self.suggestion else "remove it or check the spelling"
        return f"not {label} config key ({hint})"


@cache
def known_keys(schema: str = DEFAULT_SCHEMA) -> frozenset[str]:
    if schema not in SCHEMAS:
        raise ValueError(f"unknown NeMo-RL schema {schema!r}: choose one of {', '.join(SCHEMAS)}")
    if SCHEMAS[schema] is None:
        from bapo_nemo.plan.rules.nemo_rl_keys import installed_keys

        return installed_keys()
    text = resources.files("bapo_nemo.plan.rules").joinpath(SCHEMAS[schema]).read_text()
    return frozenset(json.loads(text)["keys"])


def _skipped(path: str) -> bool:
    return (
        any(path == s or path.startswith(s + ".") for s in OPEN_SECTIONS + OWN_SECTIONS)
        or ".env_vars." in path
    )


def unknown_keys(config: dict[str, Any], schema: str = DEFAULT_SCHEMA) -> list[UnknownKey]:
    """Every key path of `config` the schema's NeMo-RL does not know, with the closest known sibling (or the
    shipped schemas that know it)."""
    keys = known_keys(schema)
    others = [s for s, file in SCHEMAS.items() if file is not None and s != schema]
    found: list[UnknownKey] = []

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if _skipped(path):
                continue
            if path not in keys:
                siblings = [p.rsplit(".", 1)[-1] for p in keys if p.rpartition(".")[0] == prefix]
                close = difflib.get_close_matches(str(k), siblings, n=1, cutoff=0.6)
                suggestion = f"{prefix}.{close[0]}" if close and prefix else (close[0] if close else None)
                elsewhere = tuple(s for s in others if path in known_keys(s))
                found.append(UnknownKey(path, suggestion, schema, elsewhere))
                continue
            walk(v, path)

    walk(config, "")
    return found
