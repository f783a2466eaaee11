"""Every layer the driver puts on a NeMo-RL object, in one ordered list, installed in one place.

A layer wraps `policy.train`, replaces a module global NeMo-RL looks up at call time, or wraps a method of
an object setup() built. `LAYERS` is the order of installation (for `policy.train`, innermost first: the
first sees the batch last). Each entry names its upstream targets, which seams.py lists with how we know
they are live (tests/unit/test_nemo_layers.py). nemo_rl is imported inside the install functions only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bapo_nemo.algorithm.options import NemoBAPOOptions
from bapo_nemo.nemo.seams import CHECKPOINT, GRPO, LM_POLICY, LOGGER, PACKED_LOSS_PROBE, VLLM_GENERATION

BEFORE_RAY = "before ray"  # module globals; a stop signal from here on is remembered, not fatal
BEFORE_SETUP = "before setup"  # module globals that read the generation config Ray's set-up completed
AFTER_SETUP = "after setup"  # objects setup() built: the policy, its checkpointer, its logger

POLICY_TRAIN = f"{LM_POLICY}:Policy.train"


@dataclass
class Run:
    """What the layers read and leave behind, filled in by the driver as its recipe goes."""

    config: dict
    bapo: NemoBAPOOptions  # loss_fn.bapo, parsed once (BAPOLossFn is built from it)
    off_path: set[str]  # seams off the installed NeMo-RL's call path that the run goes on without
    master_config: Any = None
    tokenizer: Any = None
    policy: Any = None
    policy_generation: Any = None
    loss_fn: Any = None
    checkpointer: Any = None
    grpo_state: Any = None
    logger: Any = None
    steps: Any = None  # worker_watch.StepCounter: the one count of finished policy.train calls
    partial_hook: Any = None
    token_versions: Any = None
    checkpoint_hooks: Any = None
    tracker: Any = None
    resumed_step: int = 0
    # what setup() returned besides the objects above, and what the train loop is handed
    task_to_env: Any = None
    val_task_to_env: Any = None
    dataloader: Any = None
    val_dataloader: Any = None
    setup_loss_fn: Any = None
    teacher_worker_groups: Any = None
    alias_to_group_alias: Any = None
    async_watch: Any = None

    @property
    def checkpointing(self) -> bool:
        return bool(self.master_config.checkpointing["enabled"])


@dataclass(frozen=True)
class Layer:
    name: str
    targets: tuple[str, ...]  # seams.py targets (module:qualname) this layer wraps or replaces
    why: str
    stage: str  # BEFORE_RAY, BEFORE_SETUP or AFTER_SETUP
    install: Callable[[Run], None]
    applies: Callable[[Run], bool] = field(default=lambda run: True)


# ---- the install functions, in the order of LAYERS ------------------------------------------------------
def _stop_signal(run: Run) -> None:
    from nemo_rl.algorithms import grpo

    from bapo_nemo.nemo.stop_signal import patch_grpo_timeout_checker

    patch_grpo_timeout_checker(grpo)


def _intact_checkpoints(run: Run) -> None:
    from nemo_rl.algorithms import grpo

    from bapo_nemo.nemo.checkpoint_integrity import patch_grpo_checkpoint_manager

    patch_grpo_checkpoint_manager(grpo)


def _partial_rollouts(run: Run) -> None:
    from bapo_nemo.nemo.partial_rollout import install_partial_rollouts

    run.partial_hook = install_partial_rollouts(run.master_config)


def _token_versions(run: Run) -> None:
    from bapo_nemo.nemo.installed import async_settings
    from bapo_nemo.nemo.token_versions import TokenVersions

    run.token_versions = TokenVersions(async_settings(run.master_config)["max_trajectory_age_steps"])
    run.token_versions.install()


def packed_width_guard_needed(off_path: set[str]) -> bool:
    """Where the installed NeMo-RL's fused loss input overflows (installed.py's probe), or where the probe
    is off the loss's call path (its answer may then not be the path's; the guard is correct either way)."""
    from bapo_nemo.nemo.installed import packed_loss_needs_full_width

    return PACKED_LOSS_PROBE in off_path or packed_loss_needs_full_width()


def _packed_width_guard(run: Run) -> None:
    from bapo_nemo.nemo.packing import install_packed_width_guard

    install_packed_width_guard(run.policy, run.master_config.policy, needed=packed_width_guard_needed(run.off_path))


def _step_bounds(run: Run) -> None:
    from bapo_nemo.nemo.installed import grpo_settings
    from bapo_nemo.nemo.step_bounds import StepBoundsTrainer

    grpo = grpo_settings(run.master_config)
    run.policy.train = StepBoundsTrainer(
        run.policy,
        run.bapo,
        run.master_config.loss_fn.model_dump(),
        run.master_config.policy["train_global_batch_size"],
        group_size=grpo["num_generations_per_prompt"],
        seed=grpo.get("seed", 0),
    )


def _signal_metrics(run: Run) -> None:
    from bapo_nemo.nemo.step_signal import SignalMetricsTrainer

    run.policy.train = SignalMetricsTrainer(run.policy.train)


def _token_ages(run: Run) -> None:
    from bapo_nemo.nemo.installed import save_state_value

    run.token_versions.attach(run.policy, run.policy_generation, save_state_value(run.grpo_state, "current_step"),
                              run.master_config.logger["log_dir"])


def _checkpoint_files(run: Run) -> None:
    from bapo_nemo.nemo.checkpoint_hooks import CheckpointHooks
    from bapo_nemo.nemo.parity_recorder import PARITY_FILE, parity_writer

    run.checkpoint_hooks = CheckpointHooks(run.checkpointer)
    run.checkpoint_hooks.add(PARITY_FILE, parity_writer(run.policy, run.tokenizer, run.master_config))
    run.checkpoint_hooks.install()


def _checkpoint_watch(run: Run) -> None:
    run.policy.train = run.checkpoint_hooks.guard(run.policy.train)


def _train_counter(run: Run) -> None:
    run.policy.train = run.steps.wrap(run.policy.train)


def _tracking(run: Run) -> None:
    from bapo_nemo.nemo.checkpoint_integrity import skipped_damaged_through
    from bapo_nemo.tracking.nemo_rl import after_setup

    run.tracker = after_setup(run.master_config.model_dump(), run.logger, resumed_step=run.resumed_step,
                              logged_through=skipped_damaged_through(run.checkpointer))


def _zero_spread_watch(run: Run) -> None:
    from bapo_nemo.nemo.step_signal import warn_on_zero_spread

    warn_on_zero_spread(run.logger, lambda name, text: run.tracker.log_tags({name: text}))


def _async_loop_watch(run: Run) -> None:
    from bapo_nemo.nemo.async_end import AsyncLoopWatch
    from bapo_nemo.nemo.installed import save_state_value

    run.async_watch = AsyncLoopWatch(run.logger, save_state_value(run.grpo_state, "current_step"))


def _async(run: Run) -> bool:
    from bapo_nemo.nemo.installed import async_settings

    return async_settings(run.master_config) is not None


def _partial(run: Run) -> bool:
    return run.config.get("partial_rollouts") is not None


def _in_flight_updates(run: Run) -> bool:
    from bapo_nemo.nemo.token_versions import needs_token_versions

    return needs_token_versions(run.config)


LAYERS: tuple[Layer, ...] = (
    # -- module globals: setup() and the loops look them up when they run; each replaces its own names
    Layer("stop signal", (f"{GRPO}:TimeoutChecker",),
          "SIGUSR1 (Slurm's pre-timeout signal): checkpoint after this step, then stop", BEFORE_RAY, _stop_signal),
    Layer("intact checkpoints", (f"{GRPO}:CheckpointManager",),
          "resume from the newest intact checkpoint, never a damaged one", BEFORE_RAY, _intact_checkpoints),
    Layer("partial rollouts", (f"{GRPO}:run_multi_turn_rollout", f"{GRPO}:validate"),
          "responses cut at the token budget and resumed in later steps", BEFORE_SETUP, _partial_rollouts, _partial),
    Layer("token versions", (f"{VLLM_GENERATION}:resolve_generation_worker_cls", f"{GRPO}:refit_policy_generation"),
          "in-flight weight updates: which policy produced each token (setup() picks the worker class)",
          BEFORE_SETUP, _token_versions, _in_flight_updates),
    # -- policy.train, innermost first
    # innermost: it widens exactly the batch the workers get, after step bounds split and annotated it
    Layer("packed width guard", (POLICY_TRAIN,), "FP8 packing x fused loss: the packed width the loss expects",
          AFTER_SETUP, _packed_width_guard),
    # inside the signal metrics: they read the merged result of the whole train() call
    Layer("step bounds", (POLICY_TRAIN,), "granularity: step, one set of bounds per optimizer step",
          AFTER_SETUP, _step_bounds, lambda run: run.bapo.bapo.enabled and run.bapo.bapo.granularity == "step"),
    Layer("signal metrics", (POLICY_TRAIN,), "frac_reward_zero_std, and rho as per-step values",
          AFTER_SETUP, _signal_metrics),
    # outside the signal metrics: its one-value metrics are added after the rho shares are rewritten
    Layer("token ages", (POLICY_TRAIN,), "every trained token's policy version and age",
          AFTER_SETUP, _token_ages, lambda run: run.token_versions is not None),
    Layer("checkpoint files", (f"{CHECKPOINT}:CheckpointManager.init_tmp_checkpoint",),
          "our files (parity log-probs, partial rollouts) inside every checkpoint", AFTER_SETUP, _checkpoint_files,
          lambda run: run.checkpointing),
    # outside every layer that trains: a checkpoint renamed without our files stops the run before the next step
    Layer("checkpoint watch", (POLICY_TRAIN,), "a checkpoint's rename is seen at the next train at the latest",
          AFTER_SETUP, _checkpoint_watch, lambda run: run.checkpointing),
    # outermost: a call counts only once every layer returned; the worker watch and partial rollouts read it
    Layer("train counter", (POLICY_TRAIN,), "the step a run is in, and the policy version", AFTER_SETUP,
          _train_counter),
    # the logger: tracking first, as the zero-spread watch tags the MLflow run it opens
    Layer("mlflow tracking", (f"{LOGGER}:MLflowLogger.log_hyperparams", f"{LOGGER}:MLflowLogger.log_metrics"),
          "secrets redacted; metrics through the outage journal; a resumed run keeps its params",
          AFTER_SETUP, _tracking),
    Layer("zero-spread watch", (f"{LOGGER}:Logger.log_metrics",), "warn when most groups carry no signal",
          AFTER_SETUP, _zero_spread_watch),
    Layer("async loop watch", (f"{LOGGER}:Logger.log_metrics",),
          "the steps the async loop finished: a loop that failed and returned is not taken for a finished run",
          AFTER_SETUP, _async_loop_watch, lambda run: _async(run)),
)


def layer(name: str) -> Layer:
    return next(entry for entry in LAYERS if entry.name == name)


def install_layers(run: Run, stage: str, layers: tuple[Layer, ...] = LAYERS) -> list[str]:
    """Install the layers of `stage` that apply to this run, in the list's order; returns their names."""
    installed = []
    for layer in layers:
        if layer.stage == stage and layer.applies(run):
            layer.install(run)
            installed.append(layer.name)
    return installed
