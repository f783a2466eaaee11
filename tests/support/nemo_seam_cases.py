"""NeMo-RL trees whose call sites moved, one per seam of bapo_nemo/nemo/seams.py, and the driver run on each.

Each case copies the NeMo-RL source under test (NEMO_RL_SRC) into a temporary directory and changes one
upstream function the way a release could: the call our hook sits on goes through another name (a module
attribute instead of the global we replace, a renamed method), a keyword is dropped, a return grows. The
copy imports; only the moved call site differs. `python -m tests.support.nemo_seam_cases OUT.json WORKDIR` runs the
driver's real `main()` on every case in this process (NeMo-RL re-imported from each copy) and writes what
it returned, printed and left behind; tests/nemo_rl/test_seams.py reads it.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GRPO, LOSSES, LOGGER = "algorithms/grpo.py", "algorithms/loss/loss_functions.py", "utils/logger.py"

# The run each case needs: the 32B-64k preset (sync loop, partial rollouts, checkpoints) or the 7B preset
# turned async with a validation early stop, or with in-flight weight updates. `--skip-checks`: our config rules are not what is tested.
SYNC = ["--config", str(REPO / "configs" / "bapo_32b_64k.yaml")]
ASYNC = [
    "--config", str(REPO / "configs" / "bapo_7b.yaml"), "++grpo.async_grpo.enabled=true",
    "++grpo.stop_at_validation_metric=accuracy", "++grpo.stop_at_validation_threshold=0.9",
]
IN_FLIGHT = [
    "--config", str(REPO / "configs" / "bapo_7b.yaml"), "++grpo.async_grpo.enabled=true",
    "++grpo.async_grpo.in_flight_weight_updates=true",
]
VLLM = "models/generation/vllm"


@dataclass(frozen=True)
class Case:
    seam: str  # the qualified name in the seam's target (seams.SEAMS), which the refusal must name
    file: str  # under nemo_rl/
    function: str  # the upstream function changed (`name` or `Class.name`)
    old: str
    new: str
    run: tuple[str, ...] = tuple(SYNC)
    refuses: bool = True  # False: a seam with a fallback (seams.Seam.fallback): the run goes on, warned


CASES = {
    "loss reads its clip epsilons elsewhere": Case(
        "ClippedPGLossFn", LOSSES, "ClippedPGLossFn.__call__", "self.ratio_clip_min", "self.clip_low_eps"
    ),
    "setup returns one more value": Case("setup", GRPO, "setup", "\n    return (\n", "\n    return (\n        None,\n"),
    "grpo_train reaches TimeoutChecker through a module": Case(
        "TimeoutChecker", GRPO, "grpo_train", "TimeoutChecker(", "timers.TimeoutChecker("
    ),
    "grpo_train reaches run_multi_turn_rollout through a module": Case(
        "run_multi_turn_rollout", GRPO, "grpo_train", "= run_multi_turn_rollout(",
        "= rollouts.run_multi_turn_rollout(",
    ),
    "grpo_train reaches validate through a module": Case(
        "validate", GRPO, "grpo_train", "= validate(", "= validation.validate("
    ),
    "setup builds its checkpointer through a module": Case(
        "CheckpointManager", GRPO, "setup", "= CheckpointManager(", "= checkpoint.CheckpointManager("
    ),
    "grpo_train starts checkpoints by another method": Case(
        "CheckpointManager.init_tmp_checkpoint", GRPO, "grpo_train", "checkpointer.init_tmp_checkpoint(",
        "checkpointer.begin_checkpoint(",
    ),
    "grpo_train trains through another method": Case(
        "Policy.train", GRPO, "grpo_train", "policy.train(", "policy.train_step("
    ),
    "async loop no longer marks the step's last log": Case(
        "Logger.log_metrics", GRPO, "async_grpo_train", "step_finished=True,", "", tuple(ASYNC)
    ),
    "Logger hands params to its backends by another method": Case(
        "MLflowLogger.log_hyperparams", LOGGER, "Logger.log_hyperparams", "logger.log_hyperparams(",
        "logger.record_params(",
    ),
    "MLflowLogger summarises lists by another helper": Case(
        "MLflowLogger.log_metrics", LOGGER, "MLflowLogger.log_metrics", "_summarize_list(", "_list_summary("
    ),
    "the packed loss input packs through another helper": Case(
        "_pack_input_ids", "algorithms/loss/utils.py", "prepare_packed_loss_input", "_pack_input_ids(",
        "packing._pack_input_ids(", refuses=False,
    ),
    "Policy trains through another worker group attribute": Case(
        "RayWorkerGroup.workers", "models/policy/lm_policy.py", "Policy.train",
        "self.worker_group.run_all_workers_sharded_data(", "self.train_group.run_all_workers_sharded_data(",
        refuses=False,
    ),
    "VllmGeneration resolves its worker class through a module": Case(
        "resolve_generation_worker_cls", f"{VLLM}/vllm_generation.py", "VllmGeneration.__init__",
        "= resolve_generation_worker_cls(", "= vllm_utils.resolve_generation_worker_cls(", tuple(IN_FLIGHT),
    ),
    "the async vLLM worker reaches its engine by another name": Case(
        "VllmAsyncGenerationWorkerImpl.generate_async", f"{VLLM}/vllm_worker_async.py",
        "VllmAsyncGenerationWorkerImpl.generate_async", "self.llm.generate(", "self.engine.generate(",
        tuple(IN_FLIGHT),
    ),
    "the async vLLM worker's refit reaches its engine by another name": Case(
        "VllmAsyncGenerationWorkerImpl.update_weights_via_ipc_zmq_async", f"{VLLM}/vllm_worker_async.py",
        "VllmAsyncGenerationWorkerImpl.update_weights_via_ipc_zmq_async", "self.llm.collective_rpc(",
        "self.engine.collective_rpc(", tuple(IN_FLIGHT),
    ),
    "async loop refits through a module": Case(
        "refit_policy_generation", GRPO, "async_grpo_train", "refit_policy_generation(",
        "refit.refit_policy_generation(", tuple(IN_FLIGHT),
    ),
    "async loop decides its early stop by another helper": Case(
        "_validation_early_stop_message", GRPO, "async_grpo_train", "_validation_early_stop_message(",
        "_early_stop_message(", tuple(ASYNC),
    ),
}


def patched_copy(source: Path, case: Case, target: Path) -> bool:
    """`source`'s nemo_rl copied to `target/nemo_rl` with `case.old` -> `case.new` inside `case.function`
    only. False when the function does not contain `case.old` (the seam's site is absent upstream)."""
    shutil.copytree(source / "nemo_rl", target / "nemo_rl")
    path = target / "nemo_rl" / case.file
    text = path.read_text()
    scope: list = ast.parse(text).body
    *classes, name = case.function.split(".")
    for cls in classes:
        scope = next(n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == cls)
    node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    lines = text.splitlines(keepends=True)
    start, end = node.lineno - 1, node.end_lineno
    body = "".join(lines[start:end])
    if case.old not in body:
        return False
    path.write_text("".join(lines[:start]) + body.replace(case.old, case.new) + "".join(lines[end:]))
    return True


def import_nemo_rl_from(tree: Path) -> None:
    """Forget every imported nemo_rl module and the seams' parsed sources: the next import reads `tree`."""
    from bapo_nemo.nemo import seams

    for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        del sys.modules[name]
    sys.path[:] = [str(tree)] + [p for p in sys.path if p != str(tree)]
    seams._module_tree.cache_clear()


def run_driver(argv: list[str], tree: Path, workdir: Path) -> dict:
    """The driver's main() on NeMo-RL imported from `tree` (a fresh import of every nemo_rl module)."""
    from bapo_nemo.nemo.driver import main

    import_nemo_rl_from(tree)
    logs, checkpoints = workdir / "logs", workdir / "ckpt"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([*argv, "--skip-checks", f"logger.log_dir={logs}", f"checkpointing.checkpoint_dir={checkpoints}"])
        except SystemExit as exc:  # pragma: no cover - reported as the result
            rc = exc.code
    import nemo_rl
    import ray

    return {
        "rc": rc,
        "stderr": err.getvalue(),
        "stdout": out.getvalue(),
        "written": sorted(str(p) for p in (logs, checkpoints) if p.exists()),
        "ray_started": ray.is_initialized(),
        "nemo_rl": str(Path(nemo_rl.__file__).parent),
    }


def decision_without_refusal(argv: list[str], tree: Path) -> dict:
    """What the driver's pre-flight decides on NeMo-RL imported from `tree` for a seam with a fallback."""
    import argparse

    from bapo_nemo.nemo import seams
    from bapo_nemo.nemo.driver import load_config
    from bapo_nemo.nemo.layers import packed_width_guard_needed

    import_nemo_rl_from(tree)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        off_path = seams.verify_seams(load_config(argparse.Namespace(config=argv[1]), argv[2:]))
    return {"off_path": sorted(off_path), "stderr": err.getvalue(), "guard": packed_width_guard_needed(off_path)}


def seam_problems_of(argv: list[str]) -> list[str]:
    """The unchanged tree's verdict on a run (the control: it must start, so the driver is not run)."""
    import argparse

    from bapo_nemo.nemo.driver import load_config
    from bapo_nemo.nemo.seams import seam_report

    return seam_report(load_config(argparse.Namespace(config=argv[1]), argv[2:]))[0]


def main(out_path: str, workdir: str) -> None:
    source = Path(os.environ["NEMO_RL_SRC"])
    root = Path(workdir)
    results: dict = {"unchanged": seam_problems_of(SYNC), "unchanged, async": seam_problems_of(ASYNC),
                     "unchanged, in-flight updates": seam_problems_of(IN_FLIGHT)}
    for label, case in CASES.items():
        tree = root / f"case{len(results)}"
        applied = patched_copy(source, case, tree)
        if case.refuses:
            results[label] = {"applied": applied, "tree": str(tree), **run_driver(list(case.run), tree, tree / "run")}
        else:  # the driver would go on and start the run: its decision is what is recorded
            results[label] = {"applied": applied, "tree": str(tree), **decision_without_refusal(list(case.run), tree)}
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
