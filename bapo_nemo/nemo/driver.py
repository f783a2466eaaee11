"""The BAPO driver for NeMo-RL v0.7.0: `examples/run_grpo.py`'s flow with BAPOLossFn swapped in.

    load config (+ Hydra overrides) -> our config checks -> MLflow logger config -> MasterConfig
    -> init_ray -> tokenizer, generation config, datasets -> [partial rollouts] -> grpo.setup(...)
    -> replace setup's ClippedPGLossFn by BAPOLossFn -> [FP8 packing width guard, step-granularity
    wrapper on policy.train]
    -> MLflow tags/params -> grpo_train or async_grpo_train

Resume: v0.7.0's `setup()` looks for the newest `checkpointing.checkpoint_dir/step_N` itself
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
from bapo_nemo.plan.checks import bapo_enabled, check_config
from bapo_nemo.plan.cluster_plan import plan_cluster
from bapo_nemo.plan.config_io import get
from bapo_nemo.plan.findings import Finding
from bapo_nemo.plan.models import UnknownModelError, resolve_model


class DriverConfigError(ValueError):
    """The config would fail on the cluster; every line names a key and its fix."""


class AsyncLoopError(RuntimeError):
    """async_grpo_train returned before grpo.max_num_steps without a stop request: its loop failed."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m bapo_nemo.train",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="BAPO GRPO training on NeMo-RL v0.7.0: NeMo-RL's grpo_train with BAPOLossFn, on a Ray\n"
        "cluster inside nvcr.io/nvidia/nemo-rl:v0.7.0 (slurm/*.sbatch start it). It takes a NeMo-RL master\n"
        "config and Hydra-style overrides, as NeMo-RL's examples/run_grpo.py does.\n\n"
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
    plan, findings = plan_cluster(config, nodes, gpn)
    model = None
    try:
        model = resolve_model(str(get(config, "policy.model_name")))
    except (UnknownModelError, OSError, KeyError):
        pass  # unknown models only lose the head-divisibility rule here; `bapo-nemo check` reports it
    # Relative prompt files resolve where NeMo-RL will open them: this process's working directory.
    return findings + check_config(config, plan, model, check_paths=True, workdir=os.getcwd())


def raise_on_errors(findings: list[Finding]) -> None:
    errors = [f for f in findings if f.level == "error"]
    for f in findings:
        if f.level == "warning":
            print(f"warning: {f.key}: {f.message}", file=sys.stderr)
    if errors:
        raise DriverConfigError("config errors:\n  " + "\n  ".join(f"{f.key}: {f.message}" for f in errors))


def make_loss_fn(master_config) -> Any:
    """BAPOLossFn for this config (its DTensor layout is needed to rebuild the data-parallel group)."""
    from bapo_nemo.nemo.loss import BAPOLossFn

    policy = master_config.policy
    dtensor = policy.get("dtensor_cfg") or {}
    return BAPOLossFn(
        master_config.loss_fn,
        dtensor_tp=int(dtensor.get("tensor_parallel_size", 1) or 1),
        dtensor_cp=int(dtensor.get("context_parallel_size", 1) or 1),
    )


def install_step_bounds(policy, loss_fn, master_config) -> None:
    """granularity: step -> wrap policy.train on the driver (see step_bounds.py for the cost)."""
    from bapo_nemo.nemo.step_bounds import StepBoundsTrainer

    options = loss_fn.options
    if not options.bapo.enabled or options.bapo.granularity != "step":
        return
    policy.train = StepBoundsTrainer(
        policy,
        options,
        master_config.loss_fn.model_dump(),
        master_config.policy["train_global_batch_size"],
        group_size=master_config.grpo["num_generations_per_prompt"],
        seed=master_config.grpo.get("seed", 0),
    )


def record_finished_steps(logger) -> list[int]:
    """Wrap logger.log_metrics to record the steps the train loop finished. async_grpo_train's last act
    of a step, after training, refit, checkpoint and the other logs, is one log_metrics call with
    step_finished=True (grpo.py, lines 4301-4307): a step that failed anywhere before is not recorded."""
    finished: list[int] = []
    log_metrics = logger.log_metrics

    def recording(metrics, step, *args, **kwargs):
        log_metrics(metrics, step, *args, **kwargs)
        if kwargs.get("step_finished", args[2] if len(args) > 2 else False):
            finished.append(int(step))

    logger.log_metrics = recording
    return finished


def check_async_loop_finished(steps_done: int, max_steps: int) -> None:
    """v0.7.0's async_grpo_train catches every exception of its loop (and a failed first refit), prints
    it and returns (grpo.py, lines 3555-3562 and 4321-4325): without this check a crashed job exits 0
    and looks finished to Slurm and to a resubmitting script. A stop it was asked for (SIGUSR1 or
    checkpoint_must_save_by, both through TimeoutChecker.check_save) is a normal end."""
    from bapo_nemo.nemo.stop_signal import early_stop_reached

    if steps_done < max_steps and not early_stop_reached():
        raise AsyncLoopError(
            f"async GRPO ended after step {steps_done} of {max_steps} without a stop request: NeMo-RL's "
            "async_grpo_train printed the error of its loop above and returned; fix it and rerun the same "
            "command (it resumes from the newest checkpoint)"
        )


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)  # --help works without NeMo-RL
    wrong_tool = _embedded_config(args.config)
    if wrong_tool is not None:
        print(f"error: {wrong_tool}", file=sys.stderr)
        return 2
    try:
        from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup
    except ImportError as exc:
        raise SystemExit(
            f"NeMo-RL v0.7.0 is not importable ({exc}): run inside nvcr.io/nvidia/nemo-rl:v0.7.0 with this "
            "checkout on PYTHONPATH (see docs/nemo_rl.md); on one machine without GPUs use `bapo-nemo train`"
        ) from None
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.distributed.virtual_cluster import init_ray
    from nemo_rl.models.generation import configure_generation_config
    from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers
    from nemo_rl.utils.logger import get_next_experiment_dir
    from omegaconf import OmegaConf

    from bapo_nemo.nemo.step_signal import SignalMetricsTrainer, warn_on_zero_spread
    from bapo_nemo.tracking.nemo_rl import after_setup, prepare_logger_config

    register_omegaconf_resolvers()
    config = load_config(args.config)
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    config = OmegaConf.to_container(config, resolve=True)
    if not args.skip_checks:
        raise_on_errors(preflight(config))
    if not bapo_enabled(config):
        print("loss_fn.bapo is absent or disabled: training is plain GRPO (ClippedPGLossFn semantics)")

    config = prepare_logger_config(config)  # MLflow on, sqlite/server URI, resumed run id
    master_config = MasterConfig(**config)
    master_config.logger["log_dir"] = get_next_experiment_dir(master_config.logger["log_dir"])
    if master_config.checkpointing["enabled"]:
        print(
            f"checkpoints: {master_config.checkpointing['checkpoint_dir']} (resumes from its newest step_N)"
        )

    # SIGUSR1 (Slurm's pre-timeout signal) -> checkpoint after the current step and stop.
    from nemo_rl.algorithms import grpo as grpo_module

    from bapo_nemo.nemo.stop_signal import patch_grpo_timeout_checker

    patch_grpo_timeout_checker(grpo_module)

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

    (
        policy,
        policy_generation,
        _nemo_gym,
        _cluster,
        dataloader,
        val_dataloader,
        _setup_loss_fn,
        logger,
        checkpointer,
        grpo_state,
        master_config,
        teacher_worker_groups,
        alias_to_group_alias,
    ) = setup(master_config, tokenizer, dataset, val_dataset)
    # setup() built a ClippedPGLossFn from the same loss_fn section; its only consumer is policy.train.
    loss_fn = make_loss_fn(master_config)
    from bapo_nemo.nemo.packing import install_packed_width_guard

    install_packed_width_guard(policy, master_config.policy)  # FP8 packing x fused loss (see packing.py)
    install_step_bounds(policy, loss_fn, master_config)
    policy.train = SignalMetricsTrainer(policy.train)  # frac_reward_zero_std; rho only where defined
    if partial_hook is not None:
        partial_hook.attach(policy, checkpointer)
    if master_config.checkpointing["enabled"]:
        from bapo_nemo.nemo.parity_recorder import attach_parity_recorder

        attach_parity_recorder(checkpointer, policy, tokenizer, master_config)  # for `bapo-nemo export`'s parity
    tracker = after_setup(master_config.model_dump(), logger)
    warn_on_zero_spread(logger, lambda name, text: tracker.log_tags({name: text}))
    from bapo_nemo.nemo.deadline import apply_job_deadline

    apply_job_deadline(master_config.checkpointing)  # from the job's real end, now that set-up is done

    if master_config.grpo.get("async_grpo", {}).get("enabled", False):
        from nemo_rl.algorithms.grpo import async_grpo_train

        finished = record_finished_steps(logger)
        first_step = int(grpo_state["current_step"])
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
            max_trajectory_age_steps=master_config.grpo["async_grpo"]["max_trajectory_age_steps"],
            teacher_worker_groups=teacher_worker_groups,
            alias_to_group_alias=alias_to_group_alias,
        )
        check_async_loop_finished(max([first_step, *finished]), int(master_config.grpo["max_num_steps"]))
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
    return 0


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
