"""Every place the adapter touches NeMo-RL, and the proof that each is still on its call path.

`SEAMS` is the one table: what we wrap, replace, subclass or call privately, why, where upstream calls it,
how we know it is live, and the layers (`layers.LAYERS`) that touch it. A wrapper upstream stops calling
loses data in silence, so before Ray starts `verify_seams(config)` reads the installed NeMo-RL's source
(its AST) and refuses a run with a seam off the call path; what only the run can show is checked by
`checkpoint_hooks.CheckpointHooks.check`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from bapo_nemo.nemo.installed import TESTED_NEMO_RL, version_line

GRPO = "nemo_rl.algorithms.grpo"
LOSSES = "nemo_rl.algorithms.loss.loss_functions"
LOGGER = "nemo_rl.utils.logger"
CHECKPOINT = "nemo_rl.utils.checkpoint"
LOSS_UTILS = "nemo_rl.algorithms.loss.utils"
PACKED_LOSS_PROBE = f"{LOSS_UTILS}:_pack_input_ids"
VLLM_GENERATION = "nemo_rl.models.generation.vllm.vllm_generation"
VLLM_ASYNC_WORKER = "nemo_rl.models.generation.vllm.vllm_worker_async"
WORKER_GROUPS = "nemo_rl.distributed.worker_groups"
LM_POLICY = "nemo_rl.models.policy.lm_policy"
WORKER_WATCH = f"{WORKER_GROUPS}:RayWorkerGroup.workers"


class SeamError(RuntimeError):
    """A seam this run needs is not on the installed NeMo-RL's call path; one line per seam."""


@dataclass(frozen=True)
class Site:
    """`function` of `module` (`name` or `Class.name`) contains `code`: a call whose callee reads `code`
    (`ast.unparse`), or an attribute read equal to it."""

    module: str
    function: str
    code: str
    keyword: str | None = None  # the call passes this keyword argument
    argument: str | None = None  # the call passes this name as an argument
    global_name: bool = False  # `code` is a module name we replace: looked up as a global, not bound locally
    returns: int | None = None  # instead of `code`: every `return` gives a tuple of this many values
    loop: str = "both"  # the train loop this site is on: "sync", "async" or "both"

    def missing(self) -> str:
        """What upstream no longer does, as one clause."""
        if self.returns is not None:
            return f"{self.function} no longer returns {self.returns} values"
        if self.code.startswith("self."):
            return f"{self.function} no longer reads {self.code}"
        extra = f" with {self.keyword}=" if self.keyword else f" passing {self.argument}" if self.argument else ""
        scope = " as a module global" if self.global_name else ""
        return f"{self.function} no longer calls {self.code}(...){extra}{scope}"


def _always(_: Mapping) -> bool:
    return True


def _partial(config: Mapping) -> bool:
    return config.get("partial_rollouts") is not None


def _checkpointing(config: Mapping) -> bool:
    return bool((config.get("checkpointing") or {}).get("enabled", True))


def _validation_stop(config: Mapping) -> bool:
    return (config.get("grpo") or {}).get("stop_at_validation_metric") is not None


def _async(config: Mapping) -> bool:
    return bool(((config.get("grpo") or {}).get("async_grpo") or {}).get("enabled"))


def _in_flight_updates(config: Mapping) -> bool:
    from bapo_nemo.nemo.token_versions import needs_token_versions

    return needs_token_versions(config)


def _fp8_fused_packing(config: Mapping) -> bool:
    from bapo_nemo.nemo.packing import fused_loss_width

    return fused_loss_width(config.get("policy") or {}) is not None


@dataclass(frozen=True)
class Seam:
    target: str  # module:qualname of what we touch
    how: str
    ours: str  # where in bapo_nemo
    why: str
    sites: tuple[Site, ...]
    runtime: str = ""  # the check made while the run goes on, where the static one cannot see everything
    feature: str | None = None  # the config feature that needs this seam (None: every run)
    fallback: str | None = None  # off the call path, the run goes on this way (said as a warning): no refusal
    applies: Callable[[Mapping], bool] = field(default=_always, compare=False)
    layers: tuple[str, ...] = ()  # the entries of layers.LAYERS that touch `target` (none: not a layer)


SEAMS: tuple[Seam, ...] = (
    Seam(
        f"{LOSSES}:ClippedPGLossFn",
        "subclassed",
        "nemo/loss.py BAPOLossFn",
        "BAPO's bounds go into the parent's clip epsilons per call; the parent computes the loss",
        (
            Site(LOSSES, "ClippedPGLossFn.__call__", "self.ratio_clip_min"),
            Site(LOSSES, "ClippedPGLossFn.__call__", "self.ratio_clip_max"),
            Site(GRPO, "grpo_train", "policy.train", argument="loss_fn", loop="sync"),
            Site(GRPO, "async_grpo_train", "policy.train", argument="loss_fn", loop="async"),
        ),
    ),
    Seam(
        f"{GRPO}:setup",
        "return value unpacked",
        "nemo/driver.py main",
        "the driver takes setup()'s 13 values; a changed shape would fail after Ray, vLLM and Megatron started",
        (Site(GRPO, "setup", "", returns=13),),
    ),
    Seam(
        f"{GRPO}:TimeoutChecker",
        "module name replaced by a subclass",
        "nemo/stop_signal.py",
        "SIGUSR1 (Slurm's pre-timeout signal) makes the loop checkpoint and stop",
        (
            Site(GRPO, "grpo_train", "TimeoutChecker", global_name=True, loop="sync"),
            Site(GRPO, "grpo_train", "timeout.check_save", loop="sync"),
            Site(GRPO, "async_grpo_train", "TimeoutChecker", global_name=True, loop="async"),
            Site(GRPO, "async_grpo_train", "timeout.check_save", loop="async"),
        ),
        layers=("stop signal",),
    ),
    Seam(
        f"{GRPO}:run_multi_turn_rollout",
        "module name replaced by a wrapper",
        "nemo/partial_rollout.py",
        "partial rollouts: responses cut at the token budget and resumed in later steps",
        (
            Site(GRPO, "grpo_train", "run_multi_turn_rollout", global_name=True, loop="sync"),
            Site(GRPO, "validate", "run_multi_turn_rollout", global_name=True, loop="sync"),
        ),
        feature="partial_rollouts",
        applies=_partial,
        layers=("partial rollouts",),
    ),
    Seam(
        f"{GRPO}:validate",
        "module name replaced by a wrapper",
        "nemo/partial_rollout.py",
        "validation answers are generated to completion, not cut at the token budget",
        (Site(GRPO, "grpo_train", "validate", global_name=True, loop="sync"),),
        feature="partial_rollouts",
        applies=_partial,
        layers=("partial rollouts",),
    ),
    Seam(
        f"{GRPO}:CheckpointManager",
        "module name replaced by a subclass",
        "nemo/checkpoint_integrity.py",
        "a damaged newest checkpoint is skipped (named in one line) and the newest intact one resumed; at the "
        "next save it is moved to damaged_step_N instead of being deleted or pruned",
        (
            Site(GRPO, "setup", "CheckpointManager", global_name=True),
            Site(GRPO, "setup", "checkpointer.get_latest_checkpoint_path"),
        ),
        feature="checkpointing",
        applies=_checkpointing,
        layers=("intact checkpoints",),
    ),
    Seam(
        f"{CHECKPOINT}:CheckpointManager.init_tmp_checkpoint",
        "instance method wrapped",
        "nemo/checkpoint_hooks.py",
        "partial_rollouts.json and parity_logprobs.json are written into tmp_step_N, so they become visible "
        "with the checkpoint's rename",
        (
            Site(GRPO, "grpo_train", "checkpointer.init_tmp_checkpoint", loop="sync"),
            Site(GRPO, "async_grpo_train", "checkpointer.init_tmp_checkpoint", loop="async"),
        ),
        runtime="every step_N finalised during the run must have passed through the wrapper with its files "
        "(CheckpointHooks.check: at the next rollout, the next policy.train and the loop's end)",
        feature="checkpointing",
        applies=_checkpointing,
        layers=("checkpoint files",),
    ),
    Seam(
        f"{LM_POLICY}:Policy.train",
        "instance method wrapped",
        "nemo/step_bounds.py, packing.py, step_signal.py, partial_rollout.py, checkpoint_hooks.py, "
        "token_versions.py",
        "per-step bounds, the FP8 packed width, the signal metrics, policy versions, the checkpoint watch, "
        "per-token versions and ages",
        (
            Site(GRPO, "grpo_train", "policy.train", loop="sync"),
            Site(GRPO, "async_grpo_train", "policy.train", loop="async"),
        ),
        layers=("packed width guard", "step bounds", "signal metrics", "token ages", "checkpoint watch",
                "train counter"),
    ),
    Seam(
        f"{VLLM_GENERATION}:resolve_generation_worker_cls",
        "module name replaced by a wrapper; actor registry entry added",
        "nemo/token_versions.py TokenVersions.install",
        "in-flight weight updates: the vLLM worker class becomes a subclass that records which weights "
        "produced each token (the engine's stream says nothing about it)",
        (Site(VLLM_GENERATION, "VllmGeneration.__init__", "resolve_generation_worker_cls", global_name=True),),
        runtime="every generation worker's count of weight updates must equal the loop's refits at every "
        "train step (TokenVersions.collect), else the run stops",
        feature="grpo.async_grpo.in_flight_weight_updates",
        applies=_in_flight_updates,
        layers=("token versions",),
    ),
    Seam(
        f"{VLLM_ASYNC_WORKER}:VllmAsyncGenerationWorkerImpl.generate_async",
        "subclassed: the engine's generate wrapped per instance, the *_async weight updates wrapped",
        "nemo/token_versions.py _versioned_class",
        "the worker streams each request through self.llm.generate: the only place that sees a request's "
        "token count when a weight update lands",
        (Site(VLLM_ASYNC_WORKER, "VllmAsyncGenerationWorkerImpl.generate_async", "self.llm.generate"),),
        runtime="as above: an update path we do not wrap shows as a count that differs from the refits",
        feature="grpo.async_grpo.in_flight_weight_updates",
        applies=_in_flight_updates,
    ),
    Seam(
        f"{VLLM_ASYNC_WORKER}:VllmAsyncGenerationWorkerImpl.update_weights_via_ipc_zmq_async",
        "the engine's collective_rpc wrapped per instance: a weight update runs inside vLLM's workers with a "
        "count of each request's generated tokens",
        "nemo/token_versions.py counting_collective_rpc",
        "the engine applies an update between two of its steps, ahead of what the worker has streamed: only "
        "there is it known which tokens of each running request came before it",
        (
            Site(VLLM_ASYNC_WORKER, "VllmAsyncGenerationWorkerImpl.update_weights_via_ipc_zmq_async",
                 "self.llm.collective_rpc"),
            Site(VLLM_ASYNC_WORKER, "VllmAsyncGenerationWorkerImpl.update_weights_from_collective_async",
                 "self.llm.collective_rpc"),
        ),
        runtime="a vLLM worker without model_runner.requests stops the run at the first update "
        "(token_versions.update_and_count_generated); tests/nemo_rl/test_vllm_inflight_update.py runs it in "
        "both pinned vLLM releases",
        feature="grpo.async_grpo.in_flight_weight_updates",
        applies=_in_flight_updates,
    ),
    Seam(
        f"{GRPO}:refit_policy_generation",
        "module name replaced by a wrapper (in-flight updates); called before the async loop",
        "nemo/token_versions.py TokenVersions.install, nemo/driver.py refit_before_async_loop",
        "each refit's policy version (engine update k carried the k-th refit's weights); where the async "
        "loop samples before its first refit (installed.py), the driver refits first",
        (Site(GRPO, "async_grpo_train", "refit_policy_generation", global_name=True, loop="async"),),
        runtime="with in-flight updates, as above",
        feature="grpo.async_grpo",
        applies=_async,
        layers=("token versions",),
    ),
    Seam(
        f"{LOGGER}:Logger.log_metrics",
        "instance method wrapped",
        "nemo/async_end.py AsyncLoopWatch, nemo/step_signal.py warn_on_zero_spread",
        "the async loop's finished steps (its last log of a step says step_finished=True); the zero-spread watch",
        (
            Site(GRPO, "grpo_train", "logger.log_metrics", loop="sync"),
            Site(GRPO, "async_grpo_train", "logger.log_metrics", keyword="step_finished", loop="async"),
        ),
        layers=("zero-spread watch", "async loop watch"),
    ),
    Seam(
        f"{LOGGER}:MLflowLogger.log_hyperparams",
        "class method replaced",
        "tracking/nemo_rl.py",
        "secrets redacted before MLflow; a resumed run keeps its first params instead of failing",
        (
            Site(LOGGER, "Logger.log_hyperparams", "logger.log_hyperparams"),
            Site(GRPO, "setup", "logger.log_hyperparams"),
            Site(LOGGER, "MLflowLogger.log_hyperparams", "flatten_dict"),
        ),
        layers=("mlflow tracking",),
    ),
    Seam(
        f"{LOGGER}:MLflowLogger.log_metrics",
        "instance method replaced; private functions called",
        "tracking/nemo_rl.py",
        "metrics go through the outage journal, named as upstream names them (its own private helpers)",
        (
            Site(LOGGER, "Logger.log_metrics", "logger.log_metrics"),
            Site(LOGGER, "MLflowLogger.log_metrics", "_merge_generation_logger_workers"),
            Site(LOGGER, "MLflowLogger.log_metrics", "flatten_dict"),
            Site(LOGGER, "MLflowLogger.log_metrics", "_summarize_list"),
        ),
        layers=("mlflow tracking",),
    ),
    Seam(
        WORKER_WATCH,
        "public properties read; Ray's ActorHandle._actor_id (private) read; Policy.shutdown and "
        "VllmGeneration.shutdown wrapped on their classes (v0.7.0's async loop shuts the workers down itself: no death)",
        "nemo/worker_watch.py WorkerWatch.over, RunFailure",
        "a lost policy or generation worker ends the run at once with one line naming it (a dead rank's peers "
        "wait in a collective, the driver in ray.get); Ray's ActorDiedError names the actor by that id",
        (
            Site(WORKER_GROUPS, "RayWorkerGroup.workers", "self._workers"),
            Site(WORKER_GROUPS, "RayWorkerGroup.worker_metadata", "self._worker_metadata"),
            Site(LM_POLICY, "Policy.train", "self.worker_group.run_all_workers_sharded_data"),
            Site(VLLM_GENERATION, "VllmGeneration.generate", "self.worker_group.run_all_workers_sharded_data"),
        ),
        runtime="none needed: a handle without _actor_id only makes the line say 'a Ray worker of this run' "
        "instead of its rank (tests/unit/test_nemo_worker_watch.py checks Ray's handles and errors against each other)",
        fallback="no watch: a lost worker is seen when Ray or a collective times out (minutes), not at once",
    ),
    Seam(
        PACKED_LOSS_PROBE,
        "private function called (a probe)",
        "nemo/installed.py packed_loss_needs_full_width",
        "whether the fused packed loss input overflows on an FP8-grown last sequence (v0.7.0) or not (main, "
        "#3182): the FP8 packing-width guard (nemo/packing.py) is installed only where it does",
        (Site(LOSS_UTILS, "prepare_packed_loss_input", "_pack_input_ids", global_name=True),),
        fallback="the packing-width guard stays on (correct with or without upstream's fix; it costs host memory)",
        applies=_fp8_fused_packing,
    ),
    Seam(
        f"{GRPO}:_validation_early_stop_message",
        "private function called",
        "nemo/installed.py validation_early_stop",
        "an async loop that stopped at grpo.stop_at_validation_metric ended normally, not in a failure",
        (Site(GRPO, "async_grpo_train", "_validation_early_stop_message", global_name=True, loop="async"),),
        feature="grpo.stop_at_validation_metric",
        applies=_validation_stop,
    ),
)


# ---- the static check -----------------------------------------------------------------------------------
@cache
def _module_tree(module: str) -> ast.Module:
    return ast.parse(inspect.getsource(importlib.import_module(module)))


def _function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    scope: list[ast.stmt] = tree.body
    *classes, name = qualname.split(".")
    for cls in classes:
        scope = next((n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == cls), [])
    return next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name), None)


def _binds_locally(function: ast.AST, name: str) -> bool:
    """Whether `name` is assigned or imported inside `function` (then our module-level replacement misses)."""
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return True
    return False


def _own_nodes(function: ast.AST):
    """The nodes of `function`'s body, without those of functions defined inside it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _site_holds(function: ast.AST, site: Site) -> bool:
    if site.returns is not None:
        returns = [n for n in _own_nodes(function) if isinstance(n, ast.Return) and n.value is not None]
        return bool(returns) and all(isinstance(r.value, ast.Tuple) and len(r.value.elts) == site.returns
                                     for r in returns)
    if site.global_name and _binds_locally(function, site.code):
        return False
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == site.code:
            if site.keyword and not any(k.arg == site.keyword for k in node.keywords):
                continue
            if site.argument and not any(
                ast.unparse(a) == site.argument for a in [*node.args, *(k.value for k in node.keywords)]
            ):
                continue
            return True
        is_read = isinstance(node, ast.Attribute) and not site.keyword and not site.argument
        if is_read and ast.unparse(node) == site.code:
            return True
    return False


def _target_exists(target: str) -> bool:
    module, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError:
        return False
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True


def needed_seams(config: Mapping) -> list[Seam]:
    return [s for s in SEAMS if s.applies(config)]


def _broken(seam: Seam, loop: str) -> list[str]:
    """What of `seam` is off the installed NeMo-RL's call path (empty: it is on it)."""
    broken: list[str] = []
    if not _target_exists(seam.target):
        broken.append(f"{seam.target.replace(':', '.')} does not exist")
    for site in seam.sites:
        if site.loop not in ("both", loop):
            continue
        try:
            function = _function(_module_tree(site.module), site.function)
        except (OSError, TypeError, ImportError) as exc:  # e.g. a NeMo-RL installed without its sources
            broken.append(f"{site.module}'s source cannot be read to find the hook ({type(exc).__name__}: {exc})")
            continue
        if function is None:
            broken.append(f"{site.module}.{site.function} does not exist")
        elif not _site_holds(function, site):
            broken.append(site.missing())
    return broken


def seam_report(config: Mapping) -> tuple[list[str], dict[str, str]]:
    """(one line per seam this config needs that is off the call path and refuses the run,
    {target: warning line} for the seams off the path that the run goes on without, in another way)."""
    loop = "async" if ((config.get("grpo") or {}).get("async_grpo") or {}).get("enabled") else "sync"
    problems: list[str] = []
    fallbacks: dict[str, str] = {}
    for seam in needed_seams(config):
        broken = _broken(seam, loop)
        if not broken:
            continue
        if seam.fallback is not None:
            fallbacks[seam.target] = (
                f"{version_line()}: the probe on {seam.target.replace(':', '.')} is off the call path "
                f"({'; '.join(broken)}): {seam.fallback}"
            )
            continue
        todo = f"turn {seam.feature} off, or run" if seam.feature else "run"
        problems.append(
            f"{version_line()}: cannot place the hook on {seam.target.replace(':', '.')} ({seam.how}, "
            f"bapo_nemo/{seam.ours}): {'; '.join(broken)}. {todo.capitalize()} a tested NeMo-RL: {TESTED_NEMO_RL}"
        )
    return problems, fallbacks


def verify_seams(config: Mapping) -> set[str]:
    """Refuse the run (SeamError, one line per broken seam) before anything starts. Returns the targets of
    the broken seams the run goes on without (each said on stderr with what happens instead)."""
    problems, fallbacks = seam_report(config)
    for line in fallbacks.values():
        print(f"warning: {line}", file=sys.stderr, flush=True)
    if problems:
        raise SeamError("\n".join(problems))
    return set(fallbacks)
