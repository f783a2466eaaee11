"""The study grids: number of runs, the overrides of each cell, and that they are valid trainer configs
which share one warm-up per seed."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

# `experiments/` is a top-level directory of the repository, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bapo_nemo.embedded.config.run_config import load_config
from bapo_nemo.embedded.loop import warmup as warmup_io
from experiments.grid import BASE_CONFIG, BUDGETS, STUDIES, expand, warmup_overrides


def _by_cell(runs):
    return {(r.cell.name, r.seed): r for r in runs}


def test_staleness_grid_full_and_quick():
    runs = expand("staleness", "full")
    # 4 staleness levels x 3 methods x 3 seeds
    assert len(runs) == 4 * 3 * 3 == 36
    assert Counter(r.seed for r in runs) == {0: 12, 1: 12, 2: 12}
    cells = _by_cell(runs)
    fixed8 = cells[("updates=8/method=fixed", 2)].overrides
    assert fixed8["train.updates_per_batch"] == 8
    assert fixed8["loss_fn.bapo.enabled"] is False
    assert (fixed8["loss_fn.bapo.c_low_min"], fixed8["loss_fn.bapo.c_high_min"]) == (0.8, 1.2)
    assert fixed8["grpo.seed"] == 2 and fixed8["grpo.max_num_steps"] == BUDGETS["full"].max_steps
    higher1 = cells[("updates=1/method=clip_higher", 0)].overrides
    assert higher1["train.updates_per_batch"] == 1
    assert (
        higher1["loss_fn.bapo.enabled"],
        higher1["loss_fn.bapo.c_low_min"],
        higher1["loss_fn.bapo.c_high_min"],
    ) == (False, 0.8, 1.28)
    bapo4 = cells[("updates=4/method=bapo", 1)].overrides
    assert bapo4["loss_fn.bapo.enabled"] is True and "loss_fn.bapo.c_low_min" not in bapo4  # paper grids

    quick = expand("staleness", "quick")
    # quick keeps updates 1 and 8 x {fixed, bapo} x 2 seeds, and fewer steps
    assert len(quick) == 2 * 2 * 2 == 8
    assert {(r.overrides["train.updates_per_batch"], r.cell.labels["method"]) for r in quick} == {
        (1, "fixed"),
        (1, "bapo"),
        (8, "fixed"),
        (8, "bapo"),
    }
    assert {r.overrides["grpo.max_num_steps"] for r in quick} == {BUDGETS["quick"].max_steps}


def test_partial_and_ablation_grids():
    partial = expand("partial", "full")
    assert len(partial) == (3 + 1) * 3 == 12  # BAPO at budgets 16/32/off, fixed clip at 16; 3 seeds
    base = load_config(BASE_CONFIG)
    budgets = {
        r.display_cell.labels["budget"]: load_config(
            BASE_CONFIG, r.override_list()
        ).partial_rollouts.token_budget
        for r in partial
        if r.display_cell.labels["method"] == "bapo"
    }
    off = base.partial_rollouts.max_response_tokens
    assert budgets == {"16": 16, "32": 32, "off": off}  # budget = max_response_tokens: partial rollouts off
    # budget 16 (base.yaml's) at 2 updates is the staleness study's cell: those runs are reused, not repeated
    reused = {(r.display_cell.name, r.study, r.cell.name) for r in partial if r.shown_as}
    assert reused == {
        ("budget=16/method=fixed", "staleness", "updates=2/method=fixed"),
        ("budget=16/method=bapo", "staleness", "updates=2/method=bapo"),
    }
    assert len(expand("partial", "quick")) == 2 * 1 * 2  # budgets 16/off, BAPO only, 2 seeds
    assert len(expand("order", "quick")) == len(expand("rho0", "quick")) == 2 * 2  # two arms, two seeds

    assert len(expand("measure", "full")) == 2 * 3
    assert len(expand("order", "full")) == 3 * 3
    assert len(expand("granularity", "full")) == 2 * 3
    assert len(expand("rho0", "full")) == 3 * 3
    for name in ("measure", "order", "granularity", "rho0"):
        for r in expand(name, "full"):
            assert r.overrides["train.updates_per_batch"] == 4 and r.overrides["loss_fn.bapo.enabled"] is True

    measure = {(r.display_cell.name, r.seed): r for r in expand("measure", "full")}
    assert measure[("measure=value", 0)].overrides["loss_fn.bapo.measure"] == "value"
    # rho0's default arm (0.4) is BAPO at 4 updates of the staleness study; measure and order run at
    # rho0 = 0.5 and their default arm (gradient, paper order) is the rho0 study's 0.5 cell
    staleness_bapo4 = {
        r.seed: r for r in expand("staleness", "full") if r.cell.name == "updates=4/method=bapo"
    }
    rho05 = {r.seed: r for r in expand("rho0", "full") if r.cell.name == "rho0=0.5"}
    for study, arm, home, runs in (
        ("measure", "measure=gradient", "rho0", rho05),
        ("order", "order=paper", "rho0", rho05),
        ("rho0", "rho0=0.4", "staleness", staleness_bapo4),
    ):
        for r in expand(study, "full"):
            if r.display_cell.name == arm:
                assert r.study == home and r.run_name == runs[r.seed].run_name
                assert r.overrides == runs[r.seed].overrides
            else:
                assert r.study == study and r.shown_as is None
                if study != "rho0":
                    assert r.overrides["loss_fn.bapo.rho0"] == 0.5
    rho0 = {
        r.display_cell.name: load_config(BASE_CONFIG, r.override_list()).loss_fn.bapo.rho0
        for r in expand("rho0", "full")
    }
    assert rho0 == {"rho0=0.3": 0.3, "rho0=0.4": 0.4, "rho0=0.5": 0.5}
    gran = _by_cell(expand("granularity", "full"))
    for arm in ("microbatch", "step"):
        ov = gran[(f"granularity={arm}", 1)].overrides
        assert ov["loss_fn.bapo.granularity"] == arm and ov["policy.train_micro_batch_size"] == 8
    order = {(r.display_cell.name, r.seed): r for r in expand("order", "full")}
    recipe = order[("order=authors_recipe", 0)].overrides
    assert (
        recipe["loss_fn.bapo.order"], recipe["loss_fn.bapo.measure"], recipe["loss_fn.bapo.dual_clip"]
    ) == (
        "reference",
        "value",
        3.0,
    )
    assert order[("order=reference", 0)].overrides["loss_fn.bapo.order"] == "reference"


def test_run_names_and_fingerprints_are_unique():
    runs = {(r.study, r.run_name): r for name in STUDIES for r in expand(name, "full")}
    # 36 staleness + BAPO at budgets 16 and off x 3 seeds + value, reference, authors' recipe, 2 granularity arms,
    # rho0 0.3 and 0.5 x 3 seeds; the reused cells add nothing; round 2 (imbalance): fixed clip at 1/4/16
    # updates + the 3 other methods at 16, x 5 seeds
    assert len(runs) == 36 + 2 * 3 + 7 * 3 + (3 + 3) * 5 == 93
    within = Counter((r.study, r.fingerprint) for r in runs.values())
    assert max(within.values()) == 1  # every run computes something different
    runs = list(runs.values())
    # tracking keys do not change what a run computes
    r = runs[0]
    from experiments.grid import fingerprint

    assert fingerprint({**r.overrides, "logger.mlflow.run_name": "x"}) == r.fingerprint


@pytest.mark.parametrize("mode", ["full", "quick"])
def test_every_run_is_a_valid_config_sharing_its_seeds_warmup(mode):
    """Loads every run's overrides through the trainer's own schema, and checks the warm-up cache key
    (what the trainer compares before reusing a cached warm-up) is the warm-up job's for that seed."""
    for name in STUDIES:
        budget = STUDIES[name].budget(mode)
        warm_keys = {
            seed: warmup_io.cache_key(load_config(BASE_CONFIG, warmup_overrides(seed, mode, budget)).to_dict())
            for seed in budget.seeds
        }
        assert warm_keys[0] != warm_keys[1]  # the seed is part of the key
        for r in expand(name, mode):
            cfg = load_config(BASE_CONFIG, r.override_list())
            assert cfg.grpo.seed == r.seed
            assert cfg.train.updates_per_batch == r.overrides["train.updates_per_batch"]
            assert warmup_io.cache_key(cfg.to_dict()) == warm_keys[r.seed], r.run_name


def test_imbalance_study_has_its_own_warmups_with_looping_demonstrations():
    """Round 2 changes the warm-up (looping demonstrations): its runs must not share the first round's
    warm-ups, and every one of its runs must carry the regime's settings."""
    from experiments.grid import IMBALANCE_REGIME

    for mode in ("full", "quick"):
        study = STUDIES["imbalance"]
        budget = study.budget(mode)
        first_round = load_config(BASE_CONFIG, warmup_overrides(0, mode))
        second_round = load_config(BASE_CONFIG, warmup_overrides(0, mode, budget))
        assert first_round.warmup.loop_rate == 0 and second_round.warmup.loop_rate == dict(IMBALANCE_REGIME)["warmup.loop_rate"]
        assert warmup_io.cache_key(first_round.to_dict()) != warmup_io.cache_key(second_round.to_dict())
        runs = expand("imbalance", mode)
        assert {r.seed for r in runs} == set(budget.seeds)
        for r in runs:
            cfg = load_config(BASE_CONFIG, r.override_list())
            assert cfg.policy.optimizer.kwargs.lr == dict(IMBALANCE_REGIME)["policy.optimizer.kwargs.lr"]
            assert cfg.grpo.max_num_steps == budget.max_steps
    assert len(expand("imbalance", "full")) == 6 * 5 and len(expand("imbalance", "quick")) == 3 * 2


def test_runs_recorded_before_the_keys_took_nemo_rl_names_keep_their_names():
    """docs/results/<mode>/<study>.json lists the runs each study recorded, by name (cell, seed and the
    fingerprint of their settings). base.yaml and the cells' overrides took NeMo-RL's key names afterwards
    with every setting kept: every run keeps its name, so `experiments.run` finds them done and
    `experiments.summarize` finds them in the MLflow stores."""
    import hashlib
    import json

    from experiments.grid import SAME_SETTINGS_AS

    if hashlib.sha256(BASE_CONFIG.read_bytes()).hexdigest() not in SAME_SETTINGS_AS:
        pytest.skip("base.yaml's settings changed since the recorded studies: their runs are out of date by design")
    results = Path(__file__).resolve().parents[2] / "docs" / "results"
    for mode in ("full", "quick"):
        for name in STUDIES:
            recorded = json.loads((results / mode / f"{name}.json").read_text())
            names = set(recorded["completed"]) | set(recorded.get("not_completed", []))
            assert names == {r.run_name for r in expand(name, mode)}, (mode, name)
