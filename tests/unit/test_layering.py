"""The package's layering points downwards only: algorithm/, rollout/ and tracking/ at the bottom;
embedded/, export/ and plan/ above them; nemo/ on top. Inside plan/: rules/ at the bottom, simulation/
above it, registry.py above both, precompute.py and check_cli.py (the `bapo-nemo check` command) on top. Inside
embedded/, from the bottom: config/, model/, output/ (what a run writes), data/, loop/ (one RL step), run/ (the
command and the run's lifecycle). Read from the source's AST (module-level and
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


# What each room of plan/ must not import (plan.X: a subpackage or a module of plan/).
PLAN_ROOMS = ("rules", "simulation", "registry", "precompute", "check_cli")
PLAN_FORBIDDEN = {
    "rules": {"simulation", "registry", "precompute", "check_cli"},
    "simulation": {"registry", "precompute", "check_cli"},
    "registry": {"precompute", "check_cli"},
    "precompute": set(),  # it runs the command on the shipped presets
    "check_cli": {"precompute"},
}


def imported_subpackages(source: str, package: str = "bapo_nemo") -> set[tuple[str, int]]:
    """(subpackage, line) for every absolute `PACKAGE.X` import in `source` (package: `bapo_nemo` or a
    subpackage such as `bapo_nemo.plan`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from bapo_nemo import nemo` imports the subpackage by its alias.
            modules = (
                [f"{package}.{alias.name}" for alias in node.names]
                if node.module == package
                else [node.module]
            )
        else:
            continue
        depth = package.count(".") + 1
        for module in modules:
            parts = module.split(".")
            if parts[:depth] == package.split(".") and len(parts) > depth:
                found.add((parts[depth], node.lineno))
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


def test_the_scanner_sees_rooms_inside_plan():
    source = "from bapo_nemo.plan import registry\nfrom bapo_nemo.plan.rules.checks import x\nimport bapo_nemo.nemo\n"
    assert imported_subpackages(source, "bapo_nemo.plan") == {("registry", 1), ("rules", 2)}


@pytest.mark.parametrize("room", PLAN_ROOMS)
def test_plan_rooms_import_downwards_only(room):
    plan = PACKAGE / "plan"
    files = sorted((plan / room).rglob("*.py")) if (plan / room).is_dir() else [plan / f"{room}.py"]
    assert files and all(f.is_file() for f in files), f"no sources for bapo_nemo/plan/{room}"
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports bapo_nemo.plan.{target}"
        for path in files
        for target, line in sorted(imported_subpackages(path.read_text(), "bapo_nemo.plan"))
        if target in PLAN_FORBIDDEN[room]
    ]
    assert not bad, f"bapo_nemo/plan/{room} must not import {sorted(PLAN_FORBIDDEN[room])}:\n" + "\n".join(bad)


def test_every_module_of_plan_sits_in_a_room():
    """A new module at plan/'s top level would escape the rules above: it goes into a room or gets one."""
    top = {p.stem for p in (PACKAGE / "plan").glob("*.py")} - {"__init__"}
    rooms = {p.name for p in (PACKAGE / "plan").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert top | rooms == set(PLAN_ROOMS)


# The rooms of embedded/, bottom first: each imports only the rooms before it.
EMBEDDED_ROOMS = ("config", "model", "output", "data", "loop", "run")


def test_the_rooms_of_embedded_import_downwards_only():
    embedded = PACKAGE / "embedded"
    bad = []
    for index, room in enumerate(EMBEDDED_ROOMS):
        above = set(EMBEDDED_ROOMS[index + 1:])
        files = sorted((embedded / room).rglob("*.py"))
        assert files, f"no sources under bapo_nemo/embedded/{room}"
        bad += [
            f"{path.relative_to(PACKAGE.parent)}:{line} imports bapo_nemo.embedded.{target}"
            for path in files
            for target, line in sorted(imported_subpackages(path.read_text(), "bapo_nemo.embedded"))
            if target in above
        ]
    assert not bad, f"embedded/'s rooms import downwards only ({' < '.join(EMBEDDED_ROOMS)}):\n" + "\n".join(bad)


def test_every_module_of_embedded_sits_in_a_room():
    """A module at embedded/'s top level would escape the order above: it goes into a room."""
    embedded = PACKAGE / "embedded"
    top = {p.stem for p in embedded.glob("*.py")} - {"__init__"}
    rooms = {p.name for p in embedded.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert not top and rooms == set(EMBEDDED_ROOMS)
