"""The BAPO driver for NeMo-RL (`python -m bapo_nemo.train`): `examples/run_grpo.py`'s recipe with BAPOLossFn.

`main` reads top to bottom: load and check the config (nothing starts on a refusal), install the layers
(layers.py), set up as run_grpo.py does, attach BAPOLossFn and the layers on what setup() built, run
grpo_train or async_grpo_train, finish. Resume is NeMo-RL's own (the newest checkpoint of
`checkpointing.checkpoint_dir`). Every nemo_rl import is inside a function.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from bapo_nemo.config_kind import wrong_tool_for_embedded
from bapo_nemo.nemo.layers import AFTER_SETUP, BEFORE_RAY, BEFORE_SETUP, Run, install_layers
from bapo_nemo.plan import registry
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


def make_loss_fn(master_config, setup_loss_fn: Any = None, options: Any = None) -> Any:
    """BAPOLossFn for this config, built as setup() built its ClippedPGLossFn (same extra arguments of the
    installed NeMo-RL; its DTensor layout is needed to rebuild the data-parallel group). `options`: the
    loss_fn.bapo block the driver parsed (parsed here when None)."""
    from bapo_nemo.nemo.installed import loss_fn_kwargs
    from bapo_nemo.nemo.loss import BAPOLossFn

    dtensor = master_config.policy.get("dtensor_cfg") or {}
    return BAPOLossFn(
        master_config.loss_fn,
        dtensor_tp=int(dtensor.get("tensor_parallel_size", 1) or 1),
        dtensor_cp=int(dtensor.get("context_parallel_size", 1) or 1),
        options=options,
        **(loss_fn_kwargs(setup_loss_fn) if setup_loss_fn is not None else {}),
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


class StartRefused(Exception):
    """The run cannot start; the message is one line (or one per problem) naming the fix."""


def nemo_rl_importable() -> None:
    try:
        import nemo_rl.algorithms.grpo  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"NeMo-RL is not importable ({exc}): run inside nvcr.io/nvidia/nemo-rl:v0.7.0 (or a newer tested "
            "image) with this checkout on PYTHONPATH (see docs/nemo_rl.md); on one machine without GPUs use "
            "`bapo-nemo train`"
        ) from None


def load_and_check(args: argparse.Namespace, overrides: list[str]) -> Run:
    """The config, checked before anything starts or is written, with loss_fn.bapo parsed once."""
    wrong_tool = _embedded_config(args.config)  # said before NeMo-RL is imported: on any machine
    if wrong_tool is not None:
        raise StartRefused(wrong_tool)
    nemo_rl_importable()
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.logger import get_next_experiment_dir

    from bapo_nemo.nemo.loss import bapo_options_from_loss_config, loss_config
    from bapo_nemo.nemo.seams import SeamError
    from bapo_nemo.tracking.nemo_rl import prepare_logger_config

    try:
        config = load_config(args, overrides)
        off_path = check_before_start(config, args.skip_checks)
    except (ConfigLoadError, SeamError) as exc:  # a missing `defaults:` entry, a seam off the call path
        raise StartRefused(str(exc)) from None
    bapo = bapo_options_from_loss_config(loss_config(config["loss_fn"]))
    if not isinstance(get(config, "loss_fn.bapo"), dict) or not bapo.bapo.enabled:
        print("loss_fn.bapo is absent or disabled: training is plain GRPO (ClippedPGLossFn semantics)")
    config = prepare_logger_config(config)  # MLflow on, sqlite/server URI, resumed run id
    master_config = MasterConfig(**config)
    master_config.logger["log_dir"] = get_next_experiment_dir(master_config.logger["log_dir"])
    if master_config.checkpointing["enabled"]:
        print(f"checkpoints: {master_config.checkpointing['checkpoint_dir']} (resumes from its newest step_N)")
    return Run(config=config, bapo=bapo, off_path=off_path, master_config=master_config)


def set_up(run: Run) -> None:
    """Ray, the tokenizer, the generation config and the data, then NeMo-RL's own setup()."""
    from nemo_rl.algorithms.grpo import setup
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.distributed.virtual_cluster import init_ray
    from nemo_rl.models.generation import configure_generation_config

    mc = run.master_config
    init_ray()  # forwards PYTHONPATH (which must reach bapo_nemo) to every worker
    run.tokenizer = get_tokenizer(mc.policy["tokenizer"])
    megatron_cfg = mc.policy.get("megatron_cfg") or {}
    mc.policy["generation"] = configure_generation_config(
        mc.policy["generation"],
        run.tokenizer,
        has_refit_draft_weights=bool(mc.policy["draft"]["enabled"]),
        trains_mtp=bool(megatron_cfg.get("mtp_num_layers")),
    )
    dataset, val_dataset, run.task_to_env, run.val_task_to_env = setup_response_data(run.tokenizer, mc.data, mc.env)
    install_layers(run, BEFORE_SETUP)
    (run.policy, run.policy_generation, _nemo_gym, _cluster, run.dataloader, run.val_dataloader, run.setup_loss_fn,
     run.logger, run.checkpointer, run.grpo_state, run.master_config, run.teacher_worker_groups,
     run.alias_to_group_alias) = setup(mc, run.tokenizer, dataset, val_dataset)


def attach(run: Run) -> None:
    """BAPOLossFn in place of setup()'s ClippedPGLossFn (its only consumer is policy.train), then the layers."""
    from bapo_nemo.nemo.deadline import apply_job_deadline
    from bapo_nemo.nemo.worker_watch import StepCounter, resumed_step

    run.loss_fn = make_loss_fn(run.master_config, run.setup_loss_fn, run.bapo)
    run.resumed_step = resumed_step(run.grpo_state)  # the (intact) checkpoint setup() loaded, 0 for a fresh run
    run.steps = StepCounter(run.resumed_step)
    install_layers(run, AFTER_SETUP)
    if run.partial_hook is not None:  # its policy version is the counter's; its state goes into checkpoints
        run.partial_hook.attach(run.steps, run.checkpoint_hooks)
    apply_job_deadline(run.master_config.checkpointing)  # from the job's real end, now that set-up is done


def train(run: Run) -> None:
    """grpo_train or async_grpo_train, watched: a lost worker or a full disk ends the run with one line."""
    from bapo_nemo.nemo.installed import async_settings, checkpointer_scope
    from bapo_nemo.nemo.seams import WORKER_WATCH
    from bapo_nemo.nemo.worker_watch import FailureReport, RunFailure, WorkerWatch, newest_checkpoint_text

    checkpointing = run.master_config.checkpointing
    watched = {} if WORKER_WATCH in run.off_path else {
        "policy worker": run.policy, "generation worker": run.policy_generation}
    report = FailureReport(newest_checkpoint_text(checkpointing))
    explainers = [disk_full_explainer(checkpointing, run.checkpointer)] if run.checkpointing else []
    with (
        WorkerWatch.over(watched, run.steps, report) as worker_watch,
        RunFailure(worker_watch, explainers),
        checkpointer_scope(run.checkpointer),  # main: flushes the background finalisation on the way out
    ):
        if async_settings(run.master_config) is not None:
            run_async_loop(run)
        else:
            run_sync_loop(run)


def run_sync_loop(run: Run) -> None:
    from nemo_rl.algorithms.grpo import grpo_train

    dataloader = run.dataloader
    if run.partial_hook is not None:  # partial rollouts need more prompt groups in flight than one step trains on
        dataloader = run.partial_hook.wrap_dataloader(dataloader)
    grpo_train(run.policy, run.policy_generation, dataloader, run.val_dataloader, run.tokenizer, run.loss_fn,
               run.task_to_env, run.val_task_to_env, run.logger, run.checkpointer, run.grpo_state,
               run.master_config)


def run_async_loop(run: Run) -> None:
    from nemo_rl.algorithms.grpo import async_grpo_train

    from bapo_nemo.nemo.installed import async_settings

    refit_before_async_loop(run.policy, run.policy_generation, run.master_config)
    async_grpo_train(
        policy=run.policy, policy_generation=run.policy_generation, dataloader=run.dataloader,
        val_dataloader=run.val_dataloader, tokenizer=run.tokenizer, loss_fn=run.loss_fn,
        task_to_env=run.task_to_env, val_task_to_env=run.val_task_to_env, logger=run.logger,
        checkpointer=run.checkpointer, grpo_save_state=run.grpo_state, master_config=run.master_config,
        max_trajectory_age_steps=async_settings(run.master_config)["max_trajectory_age_steps"],
        teacher_worker_groups=run.teacher_worker_groups, alias_to_group_alias=run.alias_to_group_alias,
    )


def finish(run: Run) -> None:
    """The last checks, then MLflow: what no checkpoint covers is sent now (a failed run leaves it journaled
    for the next attempt); a run stopped to be requeued is KILLED until an attempt finishes it."""
    from bapo_nemo.nemo.stop_signal import early_stop_reached
    from bapo_nemo.tracking.nemo_rl import finish_nemo_tracking

    if run.checkpoint_hooks is not None:
        run.checkpoint_hooks.check()  # the last checkpoints, now finalised
    if run.async_watch is not None:
        run.async_watch.check(run.master_config)
    finish_nemo_tracking(run.tracker, "KILLED" if early_stop_reached() else "FINISHED")


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)  # --help works without NeMo-RL
    try:
        run = load_and_check(args, overrides)
    except StartRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    install_layers(run, BEFORE_RAY)
    set_up(run)
    attach(run)
    train(run)
    finish(run)
    return 0


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    sys.exit(main())
