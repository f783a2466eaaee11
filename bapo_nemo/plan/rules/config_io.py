"""Load a NeMo-RL master config the way NeMo-RL v0.7.0 does, without importing nemo_rl.

- `defaults:` inheritance (paths relative to the file, parents merged in order, `_override_: true`
  replaces a section); a copied preset's bare parent names are read from the shipped configs/
  (`defaults_base`);
- resolvers `${mul:a,b}`, `${div:a,b}`, `${max:a,b}`;
- Hydra-style overrides `a.b=1`, `+a.b=1` (add), `++a.b=1` (add or set), `~a.b` (delete).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bapo_nemo.config_kind import wrong_tool_for_embedded

# The shipped presets (configs/ of the checkout this package runs from).
SHIPPED_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


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


def _entries(defaults: Any) -> list[str]:
    if defaults is None:
        return []
    return [str(p) for p in defaults] if isinstance(defaults, (list, ListConfig)) else [str(defaults)]


def defaults_base(path: str | Path) -> tuple[Path, str | None]:
    """The directory `path`'s own `defaults:` entries resolve against (NeMo-RL's `base_dir`): beside the
    file, or for a copied preset the shipped configs/, with the line that says so."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return path.parent, None  # the loader reports it
    relative = [e for e in _entries(data.get("defaults") if isinstance(data, dict) else None) if not e.startswith("/")]
    beside = [e for e in relative if (path.parent / e).is_file()]
    shipped = [e for e in relative if "/" not in e and (SHIPPED_CONFIGS / e).is_file()]
    if not relative or beside or len(shipped) < len(relative):
        return path.parent, None
    note = (f"{path}: defaults {', '.join(relative)} not beside it: read from the shipped presets, "
            f"{SHIPPED_CONFIGS}")
    return SHIPPED_CONFIGS, note


def missing_default(path: Path, entry: str, resolved: Path) -> str:
    """The error for a `defaults:` entry that does not exist, with the line that fixes it."""
    if "/" not in entry and (SHIPPED_CONFIGS / entry).is_file():
        fix = f"it is a shipped preset: write `defaults: {SHIPPED_CONFIGS / entry}`"
    else:
        fix = f"write its path relative to {path.parent} or an absolute one"
    return f"{path}: defaults entry {entry!r} -> {resolved} does not exist: {fix}"


def load_with_defaults(path: str | Path, base_dir: Path | None = None) -> DictConfig:
    """`base_dir`: where this file's own `defaults:` entries resolve (default: beside it); its parents'
    entries resolve beside each parent, as NeMo-RL's `load_config_with_inheritance` does."""
    path = Path(path)
    if not path.is_file():
        raise ConfigLoadError(f"{path}: no such config file")
    try:
        config = OmegaConf.load(path)
    except (OSError, ValueError) as exc:  # yaml errors (ValueError subclasses here) carry the line
        raise ConfigLoadError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(config, DictConfig):
        raise ConfigLoadError(f"{path}: the top level must be a mapping of sections (grpo:, policy:, ...)")
    if (wrong_tool := wrong_tool_for_embedded(str(path), dict(config))) is not None:
        raise ConfigLoadError(wrong_tool)
    if "defaults" in config:
        parents = _entries(config.pop("defaults"))
        base = OmegaConf.create({})
        for parent in parents:
            parent_path = Path(parent) if parent.startswith("/") else (base_dir or path.parent) / parent
            if not parent_path.is_file():
                raise ConfigLoadError(missing_default(path, parent, parent_path))
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
    config = apply_overrides(load_with_defaults(path, defaults_base(path)[0]), list(overrides or []))
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
