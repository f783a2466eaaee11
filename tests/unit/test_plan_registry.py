"""plan/registry.py is the one list of rules that `bapo-nemo check` and the NeMo-RL driver's pre-flight
run: every `*_rules` function of plan/ is registered, each says where it runs, and the pre-flight runs
exactly the rules registered to run everywhere."""

from __future__ import annotations

import argparse
import ast
import importlib
from pathlib import Path

from bapo_nemo.plan import check_cli, registry

PLAN = Path(__file__).resolve().parents[2] / "bapo_nemo" / "plan"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def rule_functions() -> set[str]:
    """`module.function` of every public module-level function of plan/ named `*_rules` (but the
    registry's own `run_rules`)."""
    found = set()
    for path in sorted(set(PLAN.rglob("*.py")) - {PLAN / "registry.py"}):
        module = ".".join(("bapo_nemo", *path.relative_to(PLAN.parent).with_suffix("").parts))
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_rules") and not node.name.startswith("_"):
                found.add(f"{module}.{node.name}")
    return found


def test_every_rule_function_is_registered():
    registered = {f"{rule.function.__module__}.{rule.function.__name__}" for rule in registry.RULES}
    missing = rule_functions() - registered
    assert not missing, f"add these to RULES in bapo_nemo/plan/registry.py (with where they run): {sorted(missing)}"
    assert registered <= rule_functions(), "a registered function is not a public `*_rules` function of plan/"


def test_the_scan_sees_a_rule_function_and_the_registry_names_real_functions():
    assert "bapo_nemo.plan.rules.checks.loss_rules" in rule_functions()
    for rule in registry.RULES:
        module = importlib.import_module(rule.function.__module__)
        assert getattr(module, rule.function.__name__) is rule.function


def test_each_rule_says_where_it_runs_and_why_not_everywhere():
    for rule in registry.RULES:
        assert rule.runs in (registry.EVERYWHERE, registry.CHECK_ONLY), rule.name
        assert bool(rule.why) == (rule.runs == registry.CHECK_ONLY), rule.name
    assert len({rule.name for rule in registry.RULES}) == len(registry.RULES)


def test_list_rules_prints_one_line_per_rule_and_exits(capsys):
    parser = argparse.ArgumentParser()
    check_cli.configure_parser(parser)
    try:
        parser.parse_args(["--list-rules"])  # no config and no cluster shape needed
    except SystemExit as exit_:
        assert exit_.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(registry.RULES)
    by_function = {line.split()[-1]: line for line in lines}
    assert "check + pre-flight" in by_function["bapo_nemo.plan.rules.checks.loss_rules"]
    assert "check only (needs --gpu)" in by_function["bapo_nemo.plan.rules.gpus.fp8_rules"]


def test_the_pre_flight_runs_the_everywhere_rules_and_check_runs_them_all():
    """A config that breaks one everywhere rule (a key v0.7.0 does not know) and one check-only rule
    (FP8 training on an A100): the pre-flight reports the first only, `check` both."""
    parser = argparse.ArgumentParser()
    check_cli.configure_parser(parser)
    overrides = ["++policy.no_such_key=1", "policy.megatron_cfg.fp8_cfg.enabled=true"]
    args = parser.parse_intermixed_args(
        [str(CONFIGS / "bapo_7b.yaml"), *overrides, "--nodes", "1", "--gpus-per-node", "8", "--gpu", "a100-80gb"]
    )
    ctx, findings = check_cli.checked(args)
    keys = {f.key for f in findings if f.level == "error"}
    assert {"policy.no_such_key", "policy.megatron_cfg.fp8_cfg.enabled"} <= keys
    preflight = registry.check_config(ctx.config, ctx.plan, ctx.model, check_paths=not args.no_path_checks)
    pre_keys = {f.key for f in preflight if f.level == "error"}
    assert "policy.no_such_key" in pre_keys
    assert "policy.megatron_cfg.fp8_cfg.enabled" not in pre_keys
