"""The studies: which runs each one makes, as config overrides of the embedded trainer.

A study is a set of *cells* (one setting each, e.g. `bapo/u4` = BAPO at 4 updates per rollout batch)
times a list of seeds. `expand(study, mode)` turns it into `RunSpec`s, each with the exact dotted
overrides passed to `bapo_nemo.embedded.config.run_config.load_config`. Everything a run computes is decided here,
so the runner and the summary agree on what a run is by its fingerprint (a hash of its overrides).

Baselines are BAPO switched off with fixed bounds: the trainer then clips at [c_low_min, c_high_min].
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bapo_nemo.embedded.config import key_names as config_keys

Mode = Literal["full", "quick"]

BASE_CONFIG = Path(__file__).resolve().parent / "base.yaml"
# partial_rollouts.max_response_tokens of base.yaml: a token budget this large turns partial rollouts off.
PARTIAL_OFF_BUDGET = 80

# Loss presets (absolute ratio bounds, see bapo_nemo/embedded/config/run_config.py).
FIXED_CLIP = {"loss_fn.bapo.enabled": False, "loss_fn.bapo.c_low_min": 0.8, "loss_fn.bapo.c_high_min": 1.2}
CLIP_HIGHER = {
    "loss_fn.bapo.enabled": False,
    "loss_fn.bapo.c_low_min": 0.8,
    "loss_fn.bapo.c_high_min": 1.28,
}
BAPO = {"loss_fn.bapo.enabled": True}  # our defaults: paper grids and order, gradient measure, rho0 0.4
# The authors' verl recipe as shipped (BAPOConfig.from_reference_recipe() defaults): c_low 0.6->0.8 and
# c_high 1.2->2.0 in steps of 0.05, P/N target 1 (share 0.5), value measure, dual clip 3.
AUTHORS_RECIPE = {
    "loss_fn.bapo.enabled": True,
    "loss_fn.bapo.order": "reference",
    "loss_fn.bapo.measure": "value",
    "loss_fn.bapo.rho0": 0.5,
    "loss_fn.bapo.c_low_min": 0.6,
    "loss_fn.bapo.c_low_max": 0.8,
    "loss_fn.bapo.c_low_step": 0.05,
    "loss_fn.bapo.c_high_min": 1.2,
    "loss_fn.bapo.c_high_max": 2.0,
    "loss_fn.bapo.c_high_step": 0.05,
    "loss_fn.bapo.dual_clip": 3.0,
}
METHODS = {"fixed": FIXED_CLIP, "clip_higher": CLIP_HIGHER, "bapo": BAPO}
METHODS_WITH_RECIPE = {**METHODS, "bapo_authors": AUTHORS_RECIPE}

# The staleness at which the ablations run: several updates per rollout batch, where the ratio moves
# away from 1 and the bounds matter (with one update per batch the clipped ratio stays near 1).
ABLATION_UPDATES = 4


@dataclass(frozen=True)
class Budget:
    """How long each run of a mode is. `eval_every` also sets the points of the held-out curve."""

    max_steps: int
    eval_every: int
    seeds: tuple[int, ...]
    # Extra overrides for every run and warm-up of this budget (e.g. a shorter warm-up in a smoke test).
    extra: tuple[tuple[str, object], ...] = ()


BUDGETS: dict[str, Budget] = {
    "full": Budget(max_steps=40, eval_every=10, seeds=(0, 1, 2)),
    "quick": Budget(max_steps=10, eval_every=5, seeds=(0, 1)),
}

# Settings every run of every study shares (on top of experiments/base.yaml). The warm-up sections
# (seed, model, task, warmup) are never varied by a cell, so one warm-up per seed serves all runs.
COMMON: dict[str, object] = {"runtime.num_threads": 1, "runtime.progress": False}


@dataclass(frozen=True)
class Cell:
    """One setting of a study: a label per axis and the overrides it implies."""

    labels: dict[str, str]
    overrides: dict[str, object]
    # (study, cell name) whose runs this cell reuses instead of repeating them: same overrides, so the
    # same result; they are run and logged in that study's directory and MLflow store.
    same_as: tuple[str, str] | None = None

    @property
    def name(self) -> str:
        return "/".join(f"{k}={v}" for k, v in self.labels.items())

    @property
    def slug(self) -> str:
        return "__".join(f"{k}-{v}" for k, v in self.labels.items()).replace(".", "p")


@dataclass(frozen=True)
class Study:
    name: str
    description: str
    cells: tuple[Cell, ...]
    # Axis whose values get their own row of plots (the others are lines within a row); None: one row.
    row_axis: str | None = None
    # Cells dropped by --quick (by their labels); the quick variant also cuts seeds and steps (BUDGETS).
    quick_keep: tuple[dict[str, str], ...] | None = None
    # The study's own budgets per mode (its seeds, steps and the settings its regime needs, warm-up
    # included); None: the shared BUDGETS.
    budgets: dict[str, Budget] | None = None
    # Method label whose runs the others are compared with seed by seed (paired differences with 95%
    # intervals in the summary, and the regime's signature plot of that method's cells); None: no pairing.
    paired_against: str | None = None

    def budget(self, mode: Mode) -> Budget:
        return (self.budgets or BUDGETS)[mode]

    def cells_for(self, mode: Mode) -> list[Cell]:
        if mode == "quick" and self.quick_keep is not None:
            return [
                c
                for c in self.cells
                if any(all(c.labels.get(k) == v for k, v in keep.items()) for keep in self.quick_keep)
            ]
        return list(self.cells)


@dataclass(frozen=True)
class RunSpec:
    """One training run: a cell of a study at one seed, in one mode."""

    study: str  # where the run lives (directory, MLflow store)
    mode: str
    cell: Cell  # its cell in that study
    seed: int
    overrides: dict[str, object] = field(compare=False)
    shown_as: Cell | None = None  # its cell in the study that borrowed it (Cell.same_as)
    budget: Budget | None = field(default=None, compare=False)  # its warm-up is this budget's

    @property
    def display_cell(self) -> Cell:
        return self.shown_as or self.cell

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.overrides)

    @property
    def run_name(self) -> str:
        """Unique per setting: the MLflow run name and the run's directory name."""
        return f"{self.cell.slug}__seed{self.seed}__{self.fingerprint}"

    def override_list(self) -> list[str]:
        return [f"{k}={_yaml_scalar(v)}" for k, v in self.overrides.items()]


# base.yaml's text (sha256) -> the text its runs are recorded under. base.yaml was rewritten in NeMo-RL's key
# names with every setting kept: its runs keep their names, so finished studies stay finished and readable.
SAME_SETTINGS_AS = {
    "0d7017189691cc6056a0a36a7bbb0ad114f033ffb2da4e397ef5df00d953c21e":
        "2d6cab2872b3a30d9212f559e20b6a6ce1b32a6ea8c875ed0023098ada78b0dc",
}


def fingerprint(overrides: dict[str, object]) -> str:
    """8 hex digits identifying what a run computes: its overrides (tracking keys excluded) and the text
    of base.yaml, so editing the base config marks finished runs as out of date. Keys are hashed under the
    names they had before the config took NeMo-RL's names (`config_keys.old_name`), so a run keeps its
    fingerprint across that rename."""
    relevant = {
        config_keys.old_name(k): v for k, v in overrides.items() if not k.startswith(("tracking.", "logger."))
    }
    text = hashlib.sha256(BASE_CONFIG.read_bytes()).hexdigest()
    relevant["<base.yaml>"] = SAME_SETTINGS_AS.get(text, text)
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:8]


def _yaml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


# ---- the studies -------------------------------------------------------------------------------------------
def _staleness() -> Study:
    cells = tuple(
        Cell({"updates": str(u), "method": m}, {"train.updates_per_batch": u, **METHODS[m]})
        for u in (1, 2, 4, 8)
        for m in ("fixed", "clip_higher", "bapo")
    )
    return Study(
        "staleness",
        "Optimizer updates per rollout batch (1/2/4/8; the paper's staleness) x {fixed clip [0.8, 1.2], "
        "clip-higher [0.8, 1.28], BAPO}.",
        cells,
        row_axis="updates",
        quick_keep=tuple({"updates": u, "method": m} for u in ("1", "8") for m in ("fixed", "bapo")),
    )


def _partial() -> Study:
    # 16 is base.yaml's budget: those cells are the staleness study's 2-update cells, whose runs are reused.
    budgets = {"16": None, "32": 32, "off": PARTIAL_OFF_BUDGET}
    cells = tuple(
        Cell(
            {"budget": b, "method": m},
            {
                "train.updates_per_batch": 2,
                **({"partial_rollouts.token_budget": t} if t else {}),
                **METHODS[m],
            },
            same_as=("staleness", f"updates=2/method={m}") if t is None else None,
        )
        for b, t in budgets.items()
        for m in ("bapo",)
    ) + (
        Cell(
            {"budget": "16", "method": "fixed"},
            {"train.updates_per_batch": 2, **FIXED_CLIP},
            same_as=("staleness", "updates=2/method=fixed"),
        ),
    )  # free: a fixed-clip reference point
    return Study(
        "partial",
        "BAPO with partial-rollout token budgets per iteration of 16 / 32 / off, 2 updates per batch (and "
        "fixed clip at budget 16 for reference).",
        cells,
        row_axis=None,
        quick_keep=({"budget": "16", "method": "bapo"}, {"budget": "off", "method": "bapo"}),
    )


# The rho0 study's default arm is the staleness study's BAPO cell at the same staleness: reuse its runs.
DEFAULT_ARM = ("staleness", f"updates={ABLATION_UPDATES}/method=bapo")
# At rho0 = 0.4 the search hardly ever leaves its starting bounds here (the positive share at [0.6, 1.2]
# is already ~0.5-0.65, see docs/results.md), so measure and order cannot differ there: they are
# compared at rho0 = 0.5, where the search moves; their default arm is the rho0 study's 0.5 cell.
ACTIVE_SEARCH = {"loss_fn.bapo.rho0": 0.5}
ACTIVE_ARM = ("rho0", "rho0=0.5")


def _ablation(
    name: str,
    description: str,
    arms: dict[str, dict[str, object]],
    quick_arms: tuple[str, ...] | None = None,
    default_arm: str | None = None,
    base: dict[str, object] | None = None,
    reuse: tuple[str, str] = DEFAULT_ARM,
) -> Study:
    cells = tuple(
        Cell(
            {name: arm},
            {"train.updates_per_batch": ABLATION_UPDATES, **BAPO, **(base or {}), **ov},
            same_as=reuse if arm == default_arm else None,
        )
        for arm, ov in arms.items()
    )
    return Study(
        name, description, cells, quick_keep=tuple({name: arm} for arm in quick_arms) if quick_arms else None
    )


# ---- round 2: the regime BAPO is built for ------------------------------------------------------------------
# Two ingredients the first round lacked (docs/results.md, "Round 2"): wrong answers much longer than right
# ones (15% of the warm-up's demonstrations get stuck repeating a step and never answer, so failing rollouts
# run to the length limit) and heavy staleness at a doubled learning rate (up to 16 optimizer updates per
# rollout batch). Its own budgets: 5 seeds, and the regime's settings for the warm-up and every run.
IMBALANCE_REGIME: tuple[tuple[str, object], ...] = (
    ("warmup.loop_rate", 0.15),
    ("policy.optimizer.kwargs.lr", 2.0e-4),
)
IMBALANCE_STALENESS = (1, 4, 16)  # fixed clip at each: the regime's signature
IMBALANCE_COMPARED_AT = (16,)  # every method here, where fixed clip collapsed in the probes
IMBALANCE_BUDGETS = {
    "full": Budget(max_steps=40, eval_every=10, seeds=(0, 1, 2, 3, 4), extra=IMBALANCE_REGIME),
    "quick": Budget(max_steps=20, eval_every=10, seeds=(0, 1), extra=IMBALANCE_REGIME),
}


def _imbalance() -> Study:
    cells = tuple(
        Cell({"updates": str(u), "method": m}, {"train.updates_per_batch": u, **METHODS_WITH_RECIPE[m]})
        for u in IMBALANCE_STALENESS
        for m in METHODS_WITH_RECIPE
        if m == "fixed" or u in IMBALANCE_COMPARED_AT
    )
    return Study(
        "imbalance",
        "Round 2: long wrong answers (15% looping demonstrations in the warm-up) and heavy staleness "
        "(1/4/16 updates per rollout batch) at lr 2e-4; fixed clip [0.8, 1.2] at every staleness, and "
        "clip-higher [0.8, 1.28], BAPO (ours) and the authors' recipe at 16.",
        cells,
        row_axis="updates",
        quick_keep=tuple(
            {"updates": u, "method": m} for u, m in (("1", "fixed"), ("16", "fixed"), ("16", "bapo"))
        ),
        budgets=IMBALANCE_BUDGETS,
        paired_against="fixed",
    )


def _studies() -> dict[str, Study]:
    studies = [
        _staleness(),
        _partial(),
        _ablation(
            "measure",
            f"BAPO's rho measure, value (Eq. 8) vs gradient, rho0 = 0.5, {ABLATION_UPDATES} updates "
            "per batch.",
            {"gradient": {}, "value": {"loss_fn.bapo.measure": "value"}},
            default_arm="gradient",
            base=ACTIVE_SEARCH,
            reuse=ACTIVE_ARM,
        ),
        _ablation(
            "order",
            "Search order: paper (Algorithm 1) vs reference (the authors' code, same grids) vs "
            f"the authors' full recipe (P/N target 1 = share 0.5), rho0 = 0.5, {ABLATION_UPDATES} updates "
            "per batch.",
            {
                "paper": {},
                "reference": {"loss_fn.bapo.order": "reference"},
                "authors_recipe": AUTHORS_RECIPE,
            },
            quick_arms=("paper", "reference"),
            default_arm="paper",
            base=ACTIVE_SEARCH,
            reuse=ACTIVE_ARM,
        ),
        # micro_batch_size 8 (one prompt group) so that a mini-batch spans several loss calls and the two
        # granularities actually differ; with the default 32 a mini-batch (128 sequences / 4 updates) is a
        # single micro-batch.
        _ablation(
            "granularity",
            "Bound search per micro-batch (8 sequences) vs per optimizer step, "
            f"{ABLATION_UPDATES} updates per batch.",
            {
                "microbatch": {"loss_fn.bapo.granularity": "microbatch", "policy.train_micro_batch_size": 8},
                "step": {"loss_fn.bapo.granularity": "step", "policy.train_micro_batch_size": 8},
            },
        ),
        _ablation(
            "rho0",
            f"Target positive share rho0 0.3 / 0.4 / 0.5, {ABLATION_UPDATES} updates per batch.",
            {"0.3": {"loss_fn.bapo.rho0": 0.3}, "0.4": {}, "0.5": {"loss_fn.bapo.rho0": 0.5}},
            quick_arms=("0.3", "0.5"),
            default_arm="0.4",
        ),
        _imbalance(),
    ]
    return {s.name: s for s in studies}


STUDIES: dict[str, Study] = _studies()


def get_study(name: str) -> Study:
    if name not in STUDIES:
        raise KeyError(f"unknown study {name!r}; choose from: {', '.join(STUDIES)} (or 'all')")
    return STUDIES[name]


def expand(study: Study | str, mode: Mode = "full", budget: Budget | None = None) -> list[RunSpec]:
    """Every run of `study` in `mode`: cells x seeds, seed-major so that early runs cover every cell."""
    study = get_study(study) if isinstance(study, str) else study
    budget = budget or study.budget(mode)
    runs = []
    for seed in budget.seeds:
        for cell in study.cells_for(mode):
            overrides = {
                "grpo.seed": seed,
                **COMMON,
                "grpo.max_num_steps": budget.max_steps,
                "grpo.val_period": budget.eval_every,
                **dict(budget.extra),
                **cell.overrides,
            }
            if cell.same_as is None:
                runs.append(RunSpec(study.name, mode, cell, seed, overrides, budget=budget))
                continue
            home_study, home_name = cell.same_as
            home = next(c for c in get_study(home_study).cells if c.name == home_name)
            if home.overrides != cell.overrides:
                raise ValueError(
                    f"{study.name}/{cell.name} reuses {home_study}/{home_name} but their overrides differ"
                )
            runs.append(RunSpec(home_study, mode, home, seed, overrides, shown_as=cell, budget=budget))
    return runs


def warmup_overrides(seed: int, mode: Mode = "full", budget: Budget | None = None) -> list[str]:
    """Overrides of the per-seed warm-up job: the common settings and no RL steps. The warm-up cache key
    (seed, model, task, warmup) matches every run of that seed, whatever its cell."""
    budget = budget or BUDGETS[mode]
    overrides = {"grpo.seed": seed, **COMMON, **dict(budget.extra), "grpo.max_num_steps": 0}
    return [f"{k}={_yaml_scalar(v)}" for k, v in overrides.items()]
