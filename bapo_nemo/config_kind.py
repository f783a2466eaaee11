"""Which tool a config file is for: the embedded trainer (`bapo-nemo train`) or the NeMo-RL driver
(`python -m bapo_nemo.train`, checked by `bapo-nemo check`), read from the top-level sections only one of
them has (they share NeMo-RL's section names where they mean the same). A config given to the wrong tool
gets one line naming the right command. A leaf module (no imports), asked before anything heavy loads.
"""

from __future__ import annotations

from typing import Any, Literal

# The embedded trainer's own sections, and those it had before it took NeMo-RL's names.
EMBEDDED_ONLY = ("runtime", "model", "task", "warmup", "replay", "loss", "train", "eval", "tracking",
                 "rollout", "optim", "checkpoint")
# Sections of a NeMo-RL master config (or its `defaults:` inheritance) the embedded config has not.
NEMO_RL_ONLY = ("defaults", "cluster", "env", "data_plane", "on_policy_distillation")

Kind = Literal["embedded", "nemo_rl"]


def config_kind(data: Any) -> Kind | None:
    """"embedded", "nemo_rl", or None when the top-level sections do not tell (then the tool's own
    validation speaks)."""
    if not isinstance(data, dict):
        return None
    embedded = [k for k in EMBEDDED_ONLY if k in data]
    nemo_rl = [k for k in NEMO_RL_ONLY if k in data]
    if embedded and not nemo_rl:
        return "embedded"
    if nemo_rl and not embedded:
        return "nemo_rl"
    return None


def _sections(data: dict, names: tuple[str, ...]) -> str:
    found = [f"{k}:" for k in names if k in data]
    return ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")


def wrong_tool_for_embedded(path: str, data: Any) -> str | None:
    """The line for `bapo-nemo check` / the driver given an embedded config (None: it is not one)."""
    if config_kind(data) != "embedded":
        return None
    return (
        f"{path} is an embedded config for one machine ({_sections(data, EMBEDDED_ONLY)}): train it with "
        f"`bapo-nemo train {path}`; `bapo-nemo check` and `python -m bapo_nemo.train` take NeMo-RL configs "
        "such as configs/bapo_7b.yaml"
    )


def wrong_tool_for_nemo_rl(path: str, data: Any) -> str | None:
    """The line for `bapo-nemo train` given a NeMo-RL config (None: it is not one)."""
    if config_kind(data) != "nemo_rl":
        return None
    return (
        f"{path} is a NeMo-RL config ({_sections(data, NEMO_RL_ONLY)}): run it on a cluster with `python -m "
        f"bapo_nemo.train --config {path}` after `bapo-nemo check {path} --nodes N --gpus-per-node G`; "
        "`bapo-nemo train` takes embedded configs such as configs/local_cpu.yaml"
    )
