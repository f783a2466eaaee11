"""The package's layering points downwards only: algorithm/, rollout/ and tracking/ at the bottom;
embedded/, export/ and plan/ above them; nemo/ on top. Read from the source's AST (module-level and
function-local imports alike), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "bapo_nemo"

BOTTOM = ("algorithm", "rollout", "tracking")
MIDDLE = ("embedded", "export", "plan")
# What each subpackage must not import.
FORBIDDEN = {
    **{name: {"embedded", "export", "plan", "nemo"} for name in BOTTOM},
    **{name: {"nemo"} for name in MIDDLE},
}


def imported_subpackages(source: str) -> set[tuple[str, int]]:
    """(bapo_nemo subpackage, line) for every absolute `bapo_nemo.X` import in `source`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from bapo_nemo import nemo` imports the subpackage by its alias.
            modules = (
                [f"bapo_nemo.{alias.name}" for alias in node.names]
                if node.module == "bapo_nemo"
                else [node.module]
            )
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "bapo_nemo" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def test_the_scanner_sees_lazy_and_aliased_imports():
    source = (
        "import bapo_nemo.nemo.loss\n"
        "from bapo_nemo import plan\n"
        "def f():\n"
        "    from bapo_nemo.nemo.options import X\n"
        "from . import sibling\n"
    )
    assert imported_subpackages(source) == {("nemo", 1), ("plan", 2), ("nemo", 4)}


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_imports_point_down_only(subpackage):
    files = sorted((PACKAGE / subpackage).rglob("*.py"))
    assert files, f"no sources under bapo_nemo/{subpackage}"
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports bapo_nemo.{target}"
        for path in files
        for target, line in sorted(imported_subpackages(path.read_text()))
        if target in FORBIDDEN[subpackage]
    ]
    assert not bad, f"bapo_nemo/{subpackage} must not import {sorted(FORBIDDEN[subpackage])}:\n" + "\n".join(bad)


def test_relative_imports_do_not_escape_a_subpackage():
    """`from .. import x` would bypass the rule above; the package uses absolute imports only."""
    escaping = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 1
    ]
    assert not escaping, "relative imports above the subpackage: " + ", ".join(escaping)


def test_the_shared_config_error_wording_is_a_leaf():
    """bapo_nemo/config_errors.py sits below every subpackage (the bottom ones use it): it imports none."""
    assert imported_subpackages((PACKAGE / "config_errors.py").read_text()) == set()
