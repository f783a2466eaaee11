"""Load a NeMo-RL master config the way NeMo-RL v0.7.0 does, without importing nemo_rl.

- `defaults:` inheritance: a path or list of paths relative to the file; parents merged in order, then
  the file on top; a section marked `_override_: true` replaces the parent's section instead of merging.
- resolvers `${mul:a,b}`, `${div:a,b}`, `${max:a,b}` (registered by NeMo-RL's run scripts).
- Hydra-style overrides `a.b=1`, `+a.b=1` (add), `++a.b=1` (add or set), `~a.b` (delete).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigLoadError(ValueError):
    """The config file or an override cannot be read; the message names the file or the override."""


def _register_resolver(name: str, fn: Any) -> None:
    """Register `fn` under `name` with the resolver API of the installed OmegaConf, without a warning.

    The name changed meaning: in 2.3 `register_resolver(name, fn)` is the deprecated legacy API (string
    arguments) and `register_new_resolver` the current one; 2.4 deprecates `register_new_resolver` and makes
    `register_resolver` the current API, with the same keyword-only `replace`/`use_cache` options.
    """
    if "use_cache" in inspect.signature(OmegaConf.register_resolver).parameters:  # OmegaConf >= 2.4
        OmegaConf.register_resolver(name, fn)
    else:  # OmegaConf 2.3 (NeMo-RL v0.7.0 pins 2.3.0)
        OmegaConf.register_new_resolver(name, fn)


def register_resolvers() -> None:
    for name, fn in (
        ("mul", lambda a, b: a * b),
        ("div", lambda a, b: a / b),
        ("max", lambda a, b: max(a, b)),
    ):
        if not OmegaConf.has_resolver(name):
            _register_resolver(name, fn)


def _merge(base: DictConfig, child: DictConfig) -> DictConfig:
    for key in list(child.keys()):
        section = child[key]
        if isinstance(section, DictConfig) and section.get("_override_", False):
            section.pop("_override_")
            if key in base:
                base.pop(key)
    return OmegaConf.merge(base, child)


def load_with_defaults(path: str | Path) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigLoadError(f"{path}: no such config file")
    try:
        config = OmegaConf.load(path)
    except (OSError, ValueError) as exc:  # yaml errors (ValueError subclasses here) carry the line
        raise ConfigLoadError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(config, DictConfig):
        raise ConfigLoadError(f"{path}: the top level must be a mapping of sections (grpo:, policy:, ...)")
    if "defaults" in config:
        parents = config.pop("defaults")
        parents = [str(p) for p in parents] if isinstance(parents, ListConfig) else [str(parents)]
        base = OmegaConf.create({})
        for parent in parents:
            parent_path = Path(parent) if parent.startswith("/") else path.parent / parent
            if not parent_path.is_file():
                raise ConfigLoadError(f"{path}: defaults entry {parent!r} -> {parent_path} does not exist")
            base = _merge(base, load_with_defaults(parent_path))
        config = _merge(base, config)
    return config


def apply_overrides(config: DictConfig, overrides: list[str]) -> DictConfig:
    for item in overrides:
        if item.startswith("~"):
            key = item[1:].split("=", 1)[0]
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(config, parent_key) if parent_key else config
            if parent is None or leaf not in parent:
                raise ConfigLoadError(f"override {item!r}: {key} is not in the config")
            parent.pop(leaf)
            continue
        if "=" not in item:
            raise ConfigLoadError(f"override {item!r}: expected key=value (or +key=value, ++key=value, ~key)")
        key, raw = item.split("=", 1)
        add = key.startswith("+")
        key = key.lstrip("+")
        if not add and OmegaConf.select(config, key, default="__missing__") == "__missing__":
            raise ConfigLoadError(
                f"override {item!r}: {key} is not in the config; use ++{key}={raw} to add it"
            )
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigLoadError(f"override {item!r}: value is not valid YAML: {exc}") from None
        OmegaConf.update(config, key, value, force_add=True, merge=False)
    return config


def load_nemo_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The resolved master config as plain dicts/lists (what NeMo-RL's MasterConfig receives)."""
    register_resolvers()
    config = apply_overrides(load_with_defaults(path), list(overrides or []))
    try:
        return OmegaConf.to_container(config, resolve=True)
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
        raise ConfigLoadError(f"{path}: cannot resolve an interpolation: {exc}") from None


def get(config: dict, dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
