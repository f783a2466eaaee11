"""Package attributes imported on first use (PEP 562), so importing one light submodule of a package
(a pydantic config) does not pull in torch through the package's `__init__`: `bapo-nemo check` and a
config error from `bapo-nemo train` answer without torch's start-up."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, names: dict[str, list[str]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, which exports `names[submodule]` from each submodule."""
    where = {name: submodule for submodule, listed in names.items() for name in listed}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
