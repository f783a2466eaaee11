"""Key checking against NeMo-RL v0.7.0's config schema, without nemo_rl installed.

`nemo_rl_v070_keys.json` lists every key path of v0.7.0's GRPO example and recipe configs and of its
config TypedDicts (PolicyConfig, LoggerConfig, CheckpointingConfig, ClusterConfig) and
ClippedPGLossConfig. A key outside that list is almost always a typo: NeMo-RL would silently ignore
it (TypedDicts are not enforced), or fail hours in. Free-form sections (dataset options, environment
options, kwargs passed through to vLLM/HF, env vars) and our own blocks are not checked here.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import lru_cache
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


@dataclass(frozen=True)
class UnknownKey:
    path: str
    suggestion: str | None

    def message(self) -> str:
        """The reason, without the path: findings carry the key separately and print `key: message`."""
        hint = f"did you mean {self.suggestion}?" if self.suggestion else "remove it or check the spelling"
        return f"not a NeMo-RL v0.7.0 config key ({hint})"


@lru_cache(maxsize=1)
def known_keys() -> frozenset[str]:
    text = resources.files("bapo_nemo.plan").joinpath("nemo_rl_v070_keys.json").read_text()
    return frozenset(json.loads(text)["keys"])


def _skipped(path: str) -> bool:
    return (
        any(path == s or path.startswith(s + ".") for s in OPEN_SECTIONS + OWN_SECTIONS)
        or ".env_vars." in path
    )


def unknown_keys(config: dict[str, Any]) -> list[UnknownKey]:
    """Every key path of `config` that v0.7.0 does not know, with the closest known sibling."""
    keys = known_keys()
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
                found.append(
                    UnknownKey(
                        path, f"{prefix}.{close[0]}" if close and prefix else (close[0] if close else None)
                    )
                )
                continue
            walk(v, path)

    walk(config, "")
    return found
