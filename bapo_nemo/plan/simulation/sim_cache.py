"""The planner's simulations, kept between runs of `bapo-nemo check`: a result is found by a hash of the
function's inputs and of the code that computes it (the syntax trees of its module and of every
`bapo_nemo` module it imports, transitively, and `random.py`; comments and docstrings left out), so a hit
is what a fresh run would return. Looked up in this process, then `precomputed.json` beside this file
(`python -m bapo_nemo.plan.precompute`), then `$BAPO_NEMO_CACHE_DIR` (default `~/.cache/bapo-nemo/check`;
`off`: no files). Details: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # .../bapo_nemo
SHIPPED = Path(__file__).with_name("precomputed.json")
CACHE_ENV = "BAPO_NEMO_CACHE_DIR"

_memory: dict[str, Any] = {}
_shipped: dict[str, Any] | None = None
use_shipped = True  # precompute.py turns it off to compute every result afresh
# each call of this process by key: (function, args, kwargs); precompute.py and the tests read them
calls: dict[str, tuple[Callable, tuple, dict]] = {}
misses: list[str] = []  # keys computed in this process (found nowhere)


# ---- the code version -----------------------------------------------------------------------------------
def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] != "bapo_nemo":
        return None
    base = PACKAGE_ROOT.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


_FROM = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]*)", re.MULTILINE)
_IMPORT = re.compile(r"^[ \t]*import[ \t]+([\w.]+(?:[ \t]*,[ \t]*[\w.]+)*)", re.MULTILINE)


@functools.cache
def _imports(path: Path, module: str) -> frozenset[str]:
    """bapo_nemo modules `path` imports (module level or inside functions; a line of a docstring that
    reads like an import only adds a file). `from package import name` counts the submodule `name`, or
    every module of the package when `name` is not one (lazy exports)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    text = path.read_text()
    found = {name.strip() for match in _IMPORT.finditer(text) for name in match.group(1).split(",")}
    for match in _FROM.finditer(text):
        base = match.group(1)
        dots = len(base) - len(base.lstrip("."))
        if dots:
            anchor = package.split(".")[: len(package.split(".")) - dots + 1]
            base = ".".join([*anchor, base[dots:]] if base[dots:] else anchor)
        found.add(base)
        folder = PACKAGE_ROOT.joinpath(*base.split(".")[1:])
        for item in match.group(2).strip("()").split(","):
            sub = f"{base}.{item.split()[0]}" if item.split() else base
            if _module_file(sub) is not None:
                found.add(sub)
            elif (folder / "__init__.py").is_file():
                found.update(f"{base}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")
    return frozenset(name for name in found if _module_file(name) is not None)


def source_closure(module: str) -> list[Path]:
    """The files of `module` and of every bapo_nemo module it imports, transitively (with the packages'
    `__init__.py`, which run on import)."""
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        parents = [name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]
        todo.extend((_imports(path, name) | set(parents)) - set(seen))
    return [seen[name] for name in sorted(seen)]


@functools.cache
def code_version(module: str) -> str:
    digest = hashlib.sha256()
    for path in [*source_closure(module), Path(__file__), Path(random.__file__)]:
        digest.update(path.name.encode() + b"\0" + _code_of(path).encode() + b"\0")
    return digest.hexdigest()


def _code_of(path: Path) -> str:
    """A module's code without its comments and docstrings: editing prose keeps every key."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def cache_key(fn: Callable, args: tuple, kwargs: dict) -> str:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    text = f"{fn.__module__}.{fn.__qualname__}|{dict(bound.arguments)!r}|{code_version(fn.__module__)}"
    return hashlib.sha256(text.encode()).hexdigest()


# ---- values as JSON -------------------------------------------------------------------------------------
def encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"dataclass": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}
    if isinstance(value, tuple):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot keep a {type(value).__name__} in the simulation cache")


def decode(value: Any) -> Any:
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(decode(v) for v in value["tuple"])
    module, _, name = value["dataclass"].partition(":")
    if not module.startswith("bapo_nemo."):
        raise ValueError(f"simulation cache: {module} is not a bapo_nemo module")
    kind = getattr(importlib.import_module(module), name)
    return kind(**{k: decode(v) for k, v in value["fields"].items()})


# ---- where results are kept ----------------------------------------------------------------------------
def cache_dir() -> Path | None:
    setting = os.environ.get(CACHE_ENV)
    if setting == "off":
        return None
    if setting:
        return Path(setting)
    try:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # no home directory: keep nothing on disk
        return None
    return Path(base) / "bapo-nemo" / "check"


def _shipped_entries() -> dict[str, Any]:
    global _shipped
    if not use_shipped:
        return {}
    if _shipped is None:
        _shipped = json.loads(SHIPPED.read_text()) if SHIPPED.is_file() else {}
    return _shipped


def _read(key: str) -> tuple[bool, Any]:
    if key in _shipped_entries():
        return True, decode(_shipped_entries()[key])
    folder = cache_dir()
    if folder is None:
        return False, None
    try:
        return True, decode(json.loads((folder / f"{key}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False, None  # absent, or unreadable: computed again and rewritten


def _write(key: str, encoded: Any) -> None:
    folder = cache_dir()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as out:
            json.dump(encoded, out)
        os.replace(out.name, folder / f"{key}.json")  # readers never see half a file
    except OSError:
        pass  # a read-only home: the result is only not kept


def persistent(fn: Callable) -> Callable:
    """`fn` with its results kept as the module docstring says; `fn.__wrapped__` is the plain function."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        key = cache_key(fn, args, kwargs)
        calls[key] = (fn, args, kwargs)
        if key in _memory:
            return _memory[key]
        found, value = _read(key)
        if not found:
            value = fn(*args, **kwargs)
            misses.append(key)
            _write(key, encode(value))
        _memory[key] = value
        return value

    return wrapper


def result(key: str) -> Any:
    """What this process's call `key` returned."""
    return _memory[key]


def forget() -> None:
    """Drop what this process holds (the files stay): the next call reads them again."""
    global _shipped
    _memory.clear()
    calls.clear()
    misses.clear()
    _shipped = None
