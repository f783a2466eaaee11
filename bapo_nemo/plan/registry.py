"""Every rule of a NeMo-RL config, in one list that both `bapo-nemo check` and the NeMo-RL driver's
pre-flight (bapo_nemo/nemo/driver.py) run, so a rule cannot exist in one and silently not in the other.
A rule that needs the simulator or a `check` option (`--gpu`, response lengths, the batch script) is
registered `CHECK_ONLY` with the reason; `bapo-nemo check --list-rules` prints where each one runs.
tests/unit/test_plan_registry.py fails when a `*_rules` function of plan/ is missing here."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bapo_nemo.plan.rules.async_checks import async_rules
from bapo_nemo.plan.rules.checks import (
    bapo_block_rules,
    batch_rules,
    checkpoint_rules,
    generation_rules,
    key_rules,
    loss_rules,
    parallel_rules,
)
from bapo_nemo.plan.rules.cluster_plan import ClusterPlan
from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.gpus import fp8_rules
from bapo_nemo.plan.rules.length_checks import length_rules
from bapo_nemo.plan.rules.logprob_checks import logprob_mode_rules
from bapo_nemo.plan.rules.memory import memory_rules
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.rules.partial_checks import partial_rollout_rules
from bapo_nemo.plan.rules.path_checks import path_rules
from bapo_nemo.plan.rules.schema import DEFAULT_SCHEMA
from bapo_nemo.plan.simulation.bound_search_checks import search_statistics_rules
from bapo_nemo.plan.simulation.check_run import CheckRun, length_options, mode_rules, step_time_rules

EVERYWHERE = "check + pre-flight"
CHECK_ONLY = "check only"


@dataclass
class RuleContext:
    """What a rule reads. `run` is the `bapo-nemo check` run (its options and simulations); None in the
    pre-flight, which runs only the EVERYWHERE rules. `plan`/`model` are None when they could not be built
    (the rules needing them skip; the finding that says why comes from building them)."""

    config: dict
    plan: ClusterPlan | None
    model: ModelShape | None
    workdir: Path
    nemo_rl: str = DEFAULT_SCHEMA
    check_paths: bool = True
    run: CheckRun | None = None


@dataclass(frozen=True)
class Rule:
    name: str
    function: Callable  # the `*_rules` function; `call` applies it to a context
    call: Callable[[Callable, RuleContext], list[Finding]]
    runs: str  # EVERYWHERE or CHECK_ONLY
    why: str = ""  # for CHECK_ONLY: what the pre-flight lacks

    def line(self) -> str:
        where = self.runs if not self.why else f"{self.runs} ({self.why})"
        return f"{self.name:<18} {where:<60} {self.function.__module__}.{self.function.__name__}"


def _search_statistics(rule: Callable, ctx: RuleContext) -> list[Finding]:
    options = length_options(ctx.run.args)
    if isinstance(options, Finding):
        return [options]
    lengths, prompt, beta = options
    return rule(ctx.config, ctx.plan, lengths, prompt, beta)[1]


def _with_plan(call: Callable[[Callable, RuleContext], Any]) -> Callable[[Callable, RuleContext], list[Finding]]:
    return lambda rule, ctx: [] if ctx.plan is None else call(rule, ctx)


# In the order their findings are printed.
RULES: tuple[Rule, ...] = (
    Rule("keys", key_rules, lambda r, c: r(c.config, c.nemo_rl), EVERYWHERE),
    Rule("bapo block", bapo_block_rules, lambda r, c: r(c.config), EVERYWHERE),
    Rule("partial rollouts", partial_rollout_rules, lambda r, c: r(c.config), EVERYWHERE),
    Rule("async grpo", async_rules, lambda r, c: r(c.config), EVERYWHERE),
    Rule("parallel sizes", parallel_rules, _with_plan(lambda r, c: r(c.config, c.plan, c.model)), EVERYWHERE),
    Rule("batches", batch_rules, _with_plan(lambda r, c: r(c.config, c.plan)), EVERYWHERE),
    Rule("generation", generation_rules, lambda r, c: r(c.config, c.plan, c.model), EVERYWHERE),
    Rule("log-prob mode", logprob_mode_rules, lambda r, c: r(c.config, c.nemo_rl), EVERYWHERE),
    Rule("lengths", length_rules, lambda r, c: r(c.config), EVERYWHERE),
    Rule("loss", loss_rules, lambda r, c: r(c.config, c.plan), EVERYWHERE),
    Rule("checkpoints", checkpoint_rules, lambda r, c: r(c.config), EVERYWHERE),
    Rule("paths", path_rules, lambda r, c: r(c.config, c.workdir) if c.check_paths else [], EVERYWHERE),
    Rule("fp8 hardware", fp8_rules, lambda r, c: r(c.config, c.run.args.gpu), CHECK_ONLY, "needs --gpu"),
    Rule(
        "memory fit",
        memory_rules,
        _with_plan(lambda r, c: r(c.plan.backend, c.run.memory)),
        CHECK_ONLY,
        "needs --gpu",
    ),
    Rule(
        "bound search",
        search_statistics_rules,
        _search_statistics,
        CHECK_ONLY,
        "simulates the bound search",
    ),
    Rule(
        "step time, signal",
        step_time_rules,
        lambda r, c: c.run.once(r, c.run.args, c.config, c.plan, c.model)[1],
        CHECK_ONLY,
        "simulates generation; reads the batch script",
    ),
    Rule(
        "async vs sync",
        mode_rules,
        lambda r, c: c.run.once(r, c.run.args, c.config, c.plan, c.model, c.run.step)[1],
        CHECK_ONLY,
        "simulates sync, partial and async GRPO",
    ),
)


def run_rules(ctx: RuleContext) -> list[Finding]:
    """Every rule that runs here: all of them for `bapo-nemo check` (ctx.run set), else the EVERYWHERE ones."""
    return [f for rule in RULES if ctx.run is not None or rule.runs == EVERYWHERE for f in rule.call(rule.function, ctx)]


def check_config(
    config: dict,
    plan: ClusterPlan | None,
    model: ModelShape | None,
    check_paths: bool = True,
    workdir: str | Path | None = None,
    nemo_rl: str = DEFAULT_SCHEMA,
) -> list[Finding]:
    """The pre-flight: every EVERYWHERE rule, without the simulator. `workdir`: the directory the job runs
    in (relative paths resolve there; default this one). `nemo_rl`: whose keys are valid (schema.SCHEMAS)."""
    where = Path(workdir) if workdir is not None else Path(os.getcwd())
    return run_rules(RuleContext(config, plan, model, where, nemo_rl, check_paths))


def rule_lines() -> list[str]:
    """One line per rule: its name, where it runs (and why not everywhere), its function."""
    return [rule.line() for rule in RULES]
