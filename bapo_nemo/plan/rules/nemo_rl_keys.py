"""Every config key path a NeMo-RL tree knows: its `MasterConfig` types walked (TypedDicts and pydantic
models) plus the keys of its GRPO example and recipe configs (inheritance resolved). A shipped list is
regenerated from a source tree with (tests/unit/test_nemo_configs.py compares the two):

    PYTHONPATH=<tree> python -m bapo_nemo.plan.rules.nemo_rl_keys <tree> bapo_nemo/plan/rules/<file>.json
"""

from __future__ import annotations

import json
import sys
import typing
from functools import cache
from pathlib import Path
from typing import Any

import yaml

# The example and recipe configs whose keys count as known: every GRPO master config among them (top-level
# `grpo` and `policy` sections), as a user's config starts from one of them.
EXAMPLES = "examples/configs/**/*.yaml"
MAX_DEPTH = 8


# Modules whose TypedDicts specialise a config section for one backend (VllmConfig, MCoreGenerationConfig
# extend GenerationConfig; a config's `policy.generation` is one of them, though typed as the base).
SPECIALISING_MODULES = (
    "nemo_rl.models.generation.vllm.config",
    "nemo_rl.models.generation.megatron.config",
    "nemo_rl.models.generation.sglang.config",
    "nemo_rl.models.policy",
)


@cache
def _typeddict_subclasses() -> dict[int, list[type]]:
    """id(TypedDict) -> the TypedDicts in SPECIALISING_MODULES that extend it (TypedDicts do not record their
    subclasses; each records its bases in `__orig_bases__`)."""
    import importlib

    found: dict[int, list[type]] = {}
    for name in SPECIALISING_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for value in vars(module).values():
            if typing.is_typeddict(value):
                for base in getattr(value, "__orig_bases__", ()):
                    if typing.is_typeddict(base):
                        found.setdefault(id(base), []).append(value)
    return found


def _type_keys(tp: Any, prefix: str, out: set[str], depth: int = 0) -> None:
    """Key paths below `prefix` declared by the type `tp` (TypedDict, pydantic model, or a union/list of them)."""
    if depth > MAX_DEPTH:
        return
    fields: dict[str, Any] = {}
    if typing.is_typeddict(tp):
        fields = typing.get_type_hints(tp)
        for specialised in _typeddict_subclasses().get(id(tp), []):
            fields.update(typing.get_type_hints(specialised))
    elif isinstance(tp, type) and hasattr(tp, "model_fields"):  # a pydantic model
        fields = {name: f.annotation for name, f in tp.model_fields.items()}
    if fields:
        for name, annotation in fields.items():
            path = f"{prefix}.{name}" if prefix else name
            out.add(path)
            _type_keys(annotation, path, out, depth + 1)
        return
    for arg in typing.get_args(tp):
        if typing.get_origin(tp) in (dict, typing.Mapping) and arg is typing.get_args(tp)[0]:
            continue  # a dict's key type declares no key path
        _type_keys(arg, prefix, out, depth + 1)


def key_paths(node: Any, prefix: str = "") -> set[str]:
    """Every dotted key path of a nested mapping (sections and leaves)."""
    out: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.add(path)
            out |= key_paths(value, path)
    return out


def _overridden(node: Any, prefix: str = "") -> set[str]:
    """Sections marked `_override_: true`: they replace the parent's section instead of merging."""
    out: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and value.get("_override_"):
                out.add(path)
            out |= _overridden(value, path)
    return out


def config_key_paths(path: Path, memo: dict[Path, frozenset[str]] | None = None) -> frozenset[str]:
    """The key paths of a NeMo-RL config with its `defaults:` inheritance resolved, as NeMo-RL's loader
    merges them (parents in order, then the file; `_override_` sections replace). Only the keys: no
    values are resolved, and each file is read once (NeMo-RL's examples share deep parent chains)."""
    memo = {} if memo is None else memo
    path = path.resolve()
    if path in memo:
        return memo[path]
    if not path.is_file():
        raise FileNotFoundError(path)
    node = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    if not isinstance(node, dict):  # not a config (e.g. a list of prompts)
        return frozenset()
    parents = node.pop("defaults", None)
    keys: set[str] = set()
    for parent in [] if parents is None else parents if isinstance(parents, list) else [parents]:
        keys |= config_key_paths(Path(parent) if str(parent).startswith("/") else path.parent / str(parent), memo)
    for section in _overridden(node):
        keys = {k for k in keys if k != section and not k.startswith(section + ".")}
    keys |= {k for k in key_paths(node) if not k.endswith("._override_") and k != "_override_"}
    memo[path] = frozenset(keys)
    return memo[path]


def keys_of_tree(root: Path | None) -> set[str]:
    """The key paths of the importable nemo_rl's MasterConfig, plus those of the example configs under
    `root` (a NeMo-RL checkout; None or absent: the types alone)."""
    from nemo_rl.algorithms.grpo import MasterConfig

    keys: set[str] = set()
    _type_keys(MasterConfig, "", keys)
    if root is not None:
        memo: dict[Path, frozenset[str]] = {}
        for path in sorted(root.glob(EXAMPLES)):
            try:
                found = config_key_paths(path, memo)
            except (OSError, yaml.YAMLError):  # e.g. inherits from a config outside examples/configs
                continue
            if {"grpo", "policy"} <= found:
                keys |= found
    return keys


@cache
def installed_keys() -> frozenset[str]:
    """The installed NeMo-RL's keys (its example configs included where they sit beside the package, as
    in the container's /opt/nemo-rl and in a source checkout)."""
    import nemo_rl

    root = Path(nemo_rl.__file__).resolve().parents[1]
    return frozenset(keys_of_tree(root if (root / "examples" / "configs").is_dir() else None))


def main(argv: list[str]) -> None:
    """Write OUT.json: the tree's keys plus the list's `carried` keys (kept from the file when it exists)."""
    root, out = Path(argv[0]), Path(argv[1])
    carried = json.loads(out.read_text()).get("carried", []) if out.exists() else []
    keys = sorted(keys_of_tree(root) | set(carried))
    source = (
        f"NeMo-RL at {root.name}: key paths of MasterConfig's types (TypedDicts and pydantic models, with the "
        f"backend TypedDicts that specialise them) and of the GRPO configs among {EXAMPLES} (inheritance "
        "resolved), plus `carried`; made by python -m bapo_nemo.plan.rules.nemo_rl_keys"
    )
    carried_why = (
        "keys of the first hand-checked v0.7.0 list that no type or example config declares but NeMo-RL's code "
        "reads or sets (e.g. policy.megatron_cfg.train_iters, set by grpo.setup)"
    )
    document = {"source": source, "carried_why": carried_why, "carried": carried, "keys": keys}
    out.write_text(json.dumps(document, indent=0) + "\n")
    print(f"wrote {out} ({len(keys)} keys)")


if __name__ == "__main__":
    main(sys.argv[1:])
