"""The BAPO driver for NeMo-RL (v0.7.0 and main): `examples/run_grpo.py`'s flow with BAPOLossFn swapped in.

    load config (+ Hydra overrides) -> our config checks, the keys the installed NeMo-RL requires, every
    seam on its call path (seams.py) -> MLflow logger config -> MasterConfig -> init_ray -> tokenizer,
    generation config, datasets -> [partial rollouts | per-token version recording] -> grpo.setup(...)
    -> replace setup's ClippedPGLossFn by BAPOLossFn -> [FP8 packing width guard, step-granularity
    wrapper on policy.train, per-token ages] -> our files in every checkpoint, and their watch
    (checkpoint_hooks.py)
    -> MLflow tags/params -> grpo_train or async_grpo_train, inside the checkpointer's scope

Where NeMo-RL releases differ, installed.py decides from what the installed nemo_rl has.

Resume: NeMo-RL's `setup()` looks for the newest `checkpointing.checkpoint_dir/step_N` itself
(`CheckpointManager.get_latest_checkpoint_path`) and restores the GRPO state, the dataloader position,
the weights and the optimizer from it; re-running the same command resumes. The MLflow run id is
resumed by `prepare_logger_config` from the same directory.

Every nemo_rl import is inside a function: this module imports on machines without NeMo-RL.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from bapo_nemo.config_kind import wrong_tool_for_embedded
from bapo_nemo.plan import registry
from bapo_nemo.plan.rules.checks import bapo_enabled
from bapo_nemo.plan.rules.cluster_plan import plan_cluster
from bapo_nemo.plan.rules.config_io import ConfigLoadError, defaults_base, get, load_with_defaults
from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.models import UnknownModelError, resolve_model
from bapo_nemo.plan.rules.schema import DEFAULT_SCHEMA


class DriverConfigError(ValueError):
    """The config would fail on the cluster; every line names a key and its fix."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m bapo_nemo.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="BAPO GRPO training on NeMo-RL: NeMo-RL's grpo_train with BAPOLossFn, on a Ray cluster\n"
        "inside nvcr.io/nvidia/nemo-rl:v0.7.0 or a newer tested image (slurm/*.sbatch start it). It takes a\n"
        "NeMo-RL master config and Hydra-style overrides, as NeMo-RL's examples/run_grpo.py does.\n\n"
        "Not to be mixed up with `bapo-nemo train CONFIG [key=value ...]`: the single-machine trainer\n"
        "(CPU or one GPU, no NeMo-RL), which takes embedded configs such as configs/local_cpu.yaml.",
        epilog="examples:\n"
        "  python -m bapo_nemo.train --config configs/bapo_7b.yaml\n"
        "  python -m bapo_nemo.train --config configs/bapo_32b.yaml "
        "checkpointing.checkpoint_dir=/lustre/run1 cluster.num_nodes=8\n"
        "  python -m bapo_nemo.train --config configs/bapo_7b.yaml loss_fn.bapo.rho0=0.5 "
        "++logger.mlflow.tracking_uri=http://mlflow:5000 --skip-checks\n"
        "check a config first: bapo-nemo check configs/bapo_32b.yaml --nodes 8 --gpus-per-node 8",
    )
    parser.add_argument("--config", required=True, help="NeMo-RL master config, e.g. configs/bapo_32b.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="Hydra-style overrides applied to the config, as NeMo-RL reads them: a.b=1 sets a key, "
        "+a.b=1 adds one, ++a.b=1 adds or sets, ~a.b deletes (the sbatch scripts pass checkpoint_dir, "
        "log_dir and the cluster shape this way)",
    )
    parser.add_argument(
        "--skip-checks", action="store_true", help="skip bapo-nemo check's rules (not advised)"
    )
    args = parser.parse_intermixed_args(argv)
    return args, args.overrides


def _embedded_config(path: str) -> str | None:
    """The one-line pointer to `bapo-nemo train` when `path` is an embedded config (read before NeMo-RL is
    imported, so it is said on any machine)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None  # NeMo-RL's loader reports it
    return wrong_tool_for_embedded(path, data)


def preflight(config: dict) -> list[Finding]:
    """The same rules as `bapo-nemo check`, for the shape written in the config's cluster section."""
    nodes, gpn = int(get(config, "cluster.num_nodes", 1)), int(get(config, "cluster.gpus_per_node", 1))
    model = None
    try:
        model = resolve_model(str(get(config, "policy.model_name")))
    except (UnknownModelError, OSError, KeyError):
        pass  # unknown models only lose the head-divisibility rule here; `bapo-nemo check` reports it
    plan, findings = plan_cluster(config, nodes, gpn, model)
    # Relative prompt files resolve where NeMo-RL will open them: this process's working directory. Keys
    # are those of the NeMo-RL installed here, which the job runs (v0.7.0's where none is).
    return findings + registry.check_config(config, plan, model, check_paths=True, workdir=os.getcwd(), nemo_rl=_schema_here())


def _schema_here() -> str:
    try:
        import nemo_rl  # noqa: F401
    except ImportError:
        return DEFAULT_SCHEMA
    return "installed"


def raise_on_errors(findings: list[Finding]) -> None:
    errors = [f for f in findings if f.level == "error"]
    for f in findings:
        if f.level == "warning":
            print(f"warning: {f.key}: {f.message}", file=sys.stderr)
    if errors:
        raise DriverConfigError("config errors:\n  " + "\n  ".join(f"{f.key}: {f.message}" for f in errors))


def make_loss_fn(master_config, setup_loss_fn: Any = None) -> Any:
    """BAPOLossFn for this config, built as setup() built its ClippedPGLossFn (same extra arguments of the
    installed NeMo-RL; its DTensor layout is needed to rebuild the data-parallel group)."""
    from bapo_nemo.nemo.installed import loss_fn_kwargs
    from bapo_nemo.nemo.loss import BAPOLossFn

    dtensor = master_config.policy.get("dtensor_cfg") or {}
    return BAPOLossFn(
        master_config.loss_fn,
        dtensor_tp=int(dtensor.get("tensor_parallel_size", 1) or 1),
        dtensor_cp=int(dtensor.get("context_parallel_size", 1) or 1),
        **(loss_fn_kwargs(setup_loss_fn) if setup_loss_fn is not None else {}),
    )


def install_step_bounds(policy, loss_fn, master_config) -> None:
    """granularity: step -> wrap policy.train on the driver (see step_bounds.py for the cost)."""
    from bapo_nemo.nemo.installed import grpo_settings
    from bapo_nemo.nemo.step_bounds import StepBoundsTrainer

    options = loss_fn.options
    if not options.bapo.enabled or options.bapo.granularity != "step":
        return
    grpo = grpo_settings(master_config)
    policy.train = StepBoundsTrainer(
        policy,
        options,
        master_config.loss_fn.model_dump(),
        master_config.policy["train_global_batch_size"],
        group_size=grpo["num_generations_per_prompt"],
        seed=grpo.get("seed", 0),
    )


def load_config(args: argparse.Namespace, overrides: list[str]) -> dict:
    """The master config as NeMo-RL's run_grpo.py reads it (YAML + `defaults:` + Hydra overrides), resolved;
    a copied preset's bare `defaults:` names resolve against the shipped configs/ as `bapo-nemo check` reads
    them (plan/rules/config_io.py)."""
    from nemo_rl.utils.config import (
        load_config_with_inheritance,
        parse_hydra_overrides,
        register_omegaconf_resolvers,
    )
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    base_dir, note = defaults_base(args.config)
    if note is not None:
        print(note)
    try:
        config = load_config_with_inheritance(args.config, base_dir)
    except FileNotFoundError:
        load_with_defaults(args.config, base_dir)  # raises the error naming the entry and its fix
        raise
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    return OmegaConf.to_container(config, resolve=True)


def check_before_start(config: dict, skip_checks: bool) -> set[str]:
    """Everything that can refuse the run, before anything starts or is written: our config rules, the
    keys the installed NeMo-RL requires, and every seam this config needs on its call path. Returns the
    seams off the path that the run goes on without (seams.py: each has a fallback)."""
    from bapo_nemo.nemo.installed import fill_validation_sampling, required_generation_keys
    from bapo_nemo.nemo.seams import verify_seams

    if not skip_checks:
        raise_on_errors(preflight(config))
    for line in fill_validation_sampling(config, required_generation_keys()):
        print(f"{line}: the installed NeMo-RL requires it; validation samples as training does")
    return verify_seams(config)


def packed_width_guard_needed(off_path: set[str]) -> bool:
    """Whether the FP8 packing-width guard is needed: where the installed NeMo-RL's fused loss input
    overflows (installed.py's probe), or where the probe is off the loss's call path (its answer may then
    not be the path's; the guard is correct either way)."""
    from bapo_nemo.nemo.installed import packed_loss_needs_full_width
    from bapo_nemo.nemo.seams import PACKED_LOSS_PROBE

    return PACKED_LOSS_PROBE in off_path or packed_loss_needs_full_width()


def attach_checkpoint_hooks(checkpointer, policy, tokenizer, master_config, partial_hook):
    """partial_rollouts.json and the parity log-probs into every checkpoint, and the watch over them."""
    from bapo_nemo.nemo.checkpoint_hooks import CheckpointHooks
    from bapo_nemo.nemo.parity_recorder import PARITY_FILE, parity_writer

    hooks = CheckpointHooks(checkpointer)
    hooks.add(PARITY_FILE, parity_writer(policy, tokenizer, master_config))  # for `bapo-nemo export`'s parity
    if partial_hook is not None:
        partial_hook.attach(policy, hooks)
    hooks.install()
    policy.train = hooks.guard(policy.train)  # a checkpoint's rename is seen at the next train at the latest
    return hooks


DISK_FULL_EXIT = 74  # EX_IOERR: a requeue would fail the same way until space is freed


def disk_full_explainer(checkpointing, checkpointer):
    """A checkpoint save that failed for lack of space, as one line (checkpoint_integrity.py)."""
    from bapo_nemo.nemo.checkpoint_integrity import disk_full_line, no_space_left

    directory = checkpointing["checkpoint_dir"]

    def explain(exc: BaseException):
        if not no_space_left(exc, directory):
            return None
        return disk_full_line(directory, checkpointer), DISK_FULL_EXIT

    return explain


def refit_before_async_loop(policy, policy_generation, master_config) -> None:
    """Where the installed async loop starts sampling before its first refit (v0.7.0), give the generation
    engines the policy's weights first: they hold vLLM's dummy weights until then (installed.py)."""
    from nemo_rl.algorithms import grpo

    from bapo_nemo.nemo.installed import async_collects_before_first_refit

    if master_config.policy["generation"]["colocated"]["enabled"] or not async_collects_before_first_refit():
        return
    print("the installed NeMo-RL's async loop starts sampling before its first refit: refitting the generation "
          "engines with the policy's weights first (one weight transfer)")
    grpo.refit_policy_generation(policy, policy_generation, False)  # looked up here: token_versions counts it


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)  # --help works without NeMo-RL
    wrong_tool = _embedded_config(args.config)
    if wrong_tool is not None:
        print(f"error: {wrong_tool}", file=sys.stderr)
        return 2
    try:
        from nemo_rl.algorithms import grpo as grpo_module
    except ImportError as exc:
        raise SystemExit(
            f"NeMo-RL is not importable ({exc}): run inside nvcr.io/nvidia/nemo-rl:v0.7.0 (or a newer tested "
            "image) with this checkout on PYTHONPATH (see docs/nemo_rl.md); on one machine without GPUs use "
            "`bapo-nemo train`"
        ) from None
    from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.distributed.virtual_cluster import init_ray
    from nemo_rl.models.generation import configure_generation_config
    from nemo_rl.utils.logger import get_next_experiment_dir

    from bapo_nemo.nemo.async_end import AsyncLoopWatch
    from bapo_nemo.nemo.checkpoint_integrity import patch_grpo_checkpoint_manager, skipped_damaged_through
    from bapo_nemo.nemo.deadline import apply_job_deadline
    from bapo_nemo.nemo.installed import async_settings, checkpointer_scope, save_state_value
    from bapo_nemo.nemo.packing import install_packed_width_guard
    from bapo_nemo.nemo.seams import WORKER_WATCH, SeamError
    from bapo_nemo.nemo.step_signal import SignalMetricsTrainer, warn_on_zero_spread
    from bapo_nemo.nemo.stop_signal import early_stop_reached, patch_grpo_timeout_checker
    from bapo_nemo.nemo.token_versions import TokenVersions, needs_token_versions
    from bapo_nemo.nemo.worker_watch import (
        FailureReport,
        RunFailure,
        StepCounter,
        WorkerWatch,
        newest_checkpoint_text,
        resumed_step,
    )
    from bapo_nemo.tracking.nemo_rl import after_setup, finish_nemo_tracking, prepare_logger_config

    try:
        config = load_config(args, overrides)
    except ConfigLoadError as exc:  # a `defaults:` entry that does not exist: the line names the fix
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        off_path = check_before_start(config, args.skip_checks)
    except SeamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not bapo_enabled(config):
        print("loss_fn.bapo is absent or disabled: training is plain GRPO (ClippedPGLossFn semantics)")

    config = prepare_logger_config(config)  # MLflow on, sqlite/server URI, resumed run id
    master_config = MasterConfig(**config)
    master_config.logger["log_dir"] = get_next_experiment_dir(master_config.logger["log_dir"])
    checkpointing = master_config.checkpointing["enabled"]
    if checkpointing:
        print(
            f"checkpoints: {master_config.checkpointing['checkpoint_dir']} (resumes from its newest step_N)"
        )
    patch_grpo_timeout_checker(grpo_module)  # SIGUSR1 (Slurm's pre-timeout signal): checkpoint, then stop
    patch_grpo_checkpoint_manager(grpo_module)  # resume from the newest intact checkpoint, never a damaged one

    init_ray()  # forwards PYTHONPATH (which must reach bapo_nemo) to every worker
    tokenizer = get_tokenizer(master_config.policy["tokenizer"])
    megatron_cfg = master_config.policy.get("megatron_cfg") or {}
    master_config.policy["generation"] = configure_generation_config(
        master_config.policy["generation"],
        tokenizer,
        has_refit_draft_weights=bool(master_config.policy["draft"]["enabled"]),
        trains_mtp=bool(megatron_cfg.get("mtp_num_layers")),
    )
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(
        tokenizer, master_config.data, master_config.env
    )

    partial_hook = None
    if get(config, "partial_rollouts") is not None:
        from bapo_nemo.nemo.partial_rollout import install_partial_rollouts

        partial_hook = install_partial_rollouts(master_config)  # before setup(): it wraps grpo's rollout
    token_versions = None
    if needs_token_versions(config):  # in-flight weight updates: which policy produced each token
        token_versions = TokenVersions(async_settings(master_config)["max_trajectory_age_steps"])
        token_versions.install()  # before setup(): it picks the vLLM worker class and wraps grpo's refit

    (
        policy,
        policy_generation,
        _nemo_gym,
        _cluster,
        dataloader,
        val_dataloader,
        setup_loss_fn,
        logger,
        checkpointer,
        grpo_state,
        master_config,
        teacher_worker_groups,
        alias_to_group_alias,
    ) = setup(master_config, tokenizer, dataset, val_dataset)
    # setup() built a ClippedPGLossFn from the same loss_fn section; its only consumer is policy.train.
    loss_fn = make_loss_fn(master_config, setup_loss_fn)
    # FP8 packing x fused loss (see packing.py), where the installed NeMo-RL overflows
    install_packed_width_guard(policy, master_config.policy, needed=packed_width_guard_needed(off_path))
    install_step_bounds(policy, loss_fn, master_config)
    policy.train = SignalMetricsTrainer(policy.train)  # frac_reward_zero_std; rho only where defined
    if token_versions is not None:
        token_versions.attach(policy, policy_generation, save_state_value(grpo_state, "current_step"),
                              master_config.logger["log_dir"])
    hooks = None
    if checkpointing:
        hooks = attach_checkpoint_hooks(checkpointer, policy, tokenizer, master_config, partial_hook)
    elif partial_hook is not None:
        partial_hook.attach(policy)
    resumed = resumed_step(grpo_state)  # the checkpoint setup() loaded (an intact one), 0 for a fresh run
    tracker = after_setup(master_config.model_dump(), logger, resumed_step=resumed,
                          logged_through=skipped_damaged_through(checkpointer))
    warn_on_zero_spread(logger, lambda name, text: tracker.log_tags({name: text}))
    apply_job_deadline(master_config.checkpointing)  # from the job's real end, now that set-up is done

    # A lost worker ends the run at once with one line (worker_watch.py); outermost, so that the line
    # names the checkpoint main's background finalisation completed on the way out.
    steps = StepCounter(resumed)
    policy.train = steps.wrap(policy.train)
    watched = {} if WORKER_WATCH in off_path else {
        "policy worker": policy, "generation worker": policy_generation}
    report = FailureReport(newest_checkpoint_text(master_config.checkpointing))
    explainers = [disk_full_explainer(master_config.checkpointing, checkpointer)] if checkpointing else []
    async_grpo = async_settings(master_config)
    with (
        WorkerWatch.over(watched, steps, report) as worker_watch,
        RunFailure(worker_watch, explainers),
        checkpointer_scope(checkpointer),  # main: flushes the background finalisation on the way out
    ):
        if async_grpo is not None:
            from nemo_rl.algorithms.grpo import async_grpo_train

            refit_before_async_loop(policy, policy_generation, master_config)
            watch = AsyncLoopWatch(logger, save_state_value(grpo_state, "current_step"))
            async_grpo_train(
                policy=policy,
                policy_generation=policy_generation,
                dataloader=dataloader,
                val_dataloader=val_dataloader,
                tokenizer=tokenizer,
                loss_fn=loss_fn,
                task_to_env=task_to_env,
                val_task_to_env=val_task_to_env,
                logger=logger,
                checkpointer=checkpointer,
                grpo_save_state=grpo_state,
                master_config=master_config,
                max_trajectory_age_steps=async_grpo["max_trajectory_age_steps"],
                teacher_worker_groups=teacher_worker_groups,
                alias_to_group_alias=alias_to_group_alias,
            )
        else:
            grpo_train(
                policy,
                policy_generation,
                # Partial rollouts need more prompt groups in flight than one step trains on.
                partial_hook.wrap_dataloader(dataloader) if partial_hook is not None else dataloader,
                val_dataloader,
                tokenizer,
                loss_fn,
                task_to_env,
                val_task_to_env,
                logger,
                checkpointer,
                grpo_state,
                master_config,
            )
    if hooks is not None:
        hooks.check()  # the last checkpoints, now finalised
    if async_grpo is not None:
        watch.check(master_config)
    # What no checkpoint covers is sent now (a failed run leaves it journaled for the next attempt); a run
    # stopped to be requeued is KILLED until an attempt finishes it, as the one-machine trainer marks it.
    finish_nemo_tracking(tracker, "KILLED" if early_stop_reached() else "FINISHED")
    return 0


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
