"""The engine's `worker_extension_cls` in the tests (tests/support/vllm_engine.py): imported inside vLLM's
worker process before it loads the model, it keeps the linear layers' weights as parameters on the CPU
backend, as they are on a GPU, makes the worker's CUDA synchronise a no-op where there is no CUDA device,
and gives the worker the end of a refit. For the tests of in-flight updates it also watches the engine's
steps (`watch_steps`): the engine's own record of which weights sampled each token, and a request held
across an update by construction (`hold_a_request`).

Why the synchronise: with PyPI's torch (a CUDA build, NeMo-RL's pin) and no GPU, the worker's shutdown
calls `torch.accelerator.synchronize()`, which initialises CUDA and raises "Found no NVIDIA driver".

Why the weights: vLLM's CPU build pre-packs every linear weight once after loading (oneDNN or its own
kernels) and frees the parameter (`dispatch_cpu_unquantized_gemm`, `remove_weight=True`); the output layer
keeps its parameter but computes from the packed copy. A refit (`model.load_weights` with new tensors,
where NeMo-RL's weight transport ends) then finds empty parameters, or updates a parameter nothing reads.
On a GPU, vLLM's unquantised layers read their parameters at every call; here they do the same through
`torch.nn.functional.linear`, vLLM's own fallback on CPUs without oneDNN. Nothing else is changed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.model_executor.layers import utils as layer_utils

from tests.support.nemo_faults import RECORD_DIR_ENV
from tests.support.vllm_engine import ENGINE_ID_ENV, REFIT_FILE_ENV


def _read_parameters_at_each_call(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


if not hasattr(layer_utils, "dispatch_cpu_unquantized_gemm"):
    raise ImportError(
        "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is gone from this vLLM release: find "
        "where its CPU backend now packs linear weights and keep them as parameters there instead"
    )
layer_utils.dispatch_cpu_unquantized_gemm = _read_parameters_at_each_call
if not torch.cuda.is_available():
    torch.accelerator.synchronize = lambda *args, **kwargs: None


@dataclass
class Hold:
    """A request to hold across the engine's next weight update (RefitExtension.hold_a_request)."""

    at_tokens: int
    after_finished: int  # the engine's count of finished requests the candidates arrive after
    candidates: list[str] = field(default_factory=list)  # in order of arrival
    updates_at_arrival: int = 0  # updates applied when the first candidate arrived
    paused: bool = False


@dataclass
class Sampling:
    """What the engine knows of one request while it runs: the updates applied before it arrived, and its
    generated-token count at each update applied since (the tokens after it are the new weights')."""

    arrived_after_updates: int
    tokens_at_update: list[int] = field(default_factory=list)

    def versions(self, tokens: int) -> list[int]:
        """Per generated token, the count of weight updates the engine had applied when it sampled it."""
        return [self.arrived_after_updates + sum(n <= i for n in self.tokens_at_update) for i in range(tokens)]


def engine_core():
    """The vLLM engine core calling this worker (same process: the uniprocess executor), found up the calling
    frames of its step or utility call: the worker has no reference to it, and only it holds the scheduler."""
    from vllm.v1.engine.core import EngineCore

    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), EngineCore):
            return frame.f_locals["self"]
        frame = frame.f_back
    raise RuntimeError("the engine's worker was stepped from outside vLLM's EngineCore: no scheduler to pause")


# The optimizer steps the weights the engine serves have seen, from the last refit the mailbox brought (the
# engine's worker runs in the generation worker's process: tests/support/nemo_vllm_worker.py reads it).
LOADED_POLICY_STEPS: list[int] = []


class RefitExtension:
    """Mixed into vLLM's worker class; its methods are called by name with `collective_rpc`."""

    def bind_numa(self) -> bool:
        """NeMo-RL's worker calls this after start-up to pin the worker to its GPU's NUMA node: no GPU here."""
        return False

    def report_device_id(self) -> str:
        """NeMo-RL's worker asks for its device's UUID (the key of its CUDA-IPC refit): the CPU here."""
        return f"cpu-{os.getpid()}"

    def hold_a_request(self, at_tokens: int, after_finished: int = 0) -> None:
        """Hold a request across the next weight update: the first to arrive once `after_finished` more
        requests have finished that has sampled `at_tokens` tokens and will go on (the last one stops it
        neither by a stop token nor by its length). Right after that step the engine pauses (upstream's
        `pause_scheduler(mode="keep")`: nothing is scheduled, utility calls still run) until the next
        weight update is applied, so the update lands after exactly `at_tokens` of its tokens; unless an
        update lands first while those requests run."""
        self.watch_steps()
        self.hold = Hold(at_tokens, self.finished_requests + after_finished)

    def watch_steps(self) -> None:
        """Wrap this worker's `execute_model` and `sample_tokens` (what the engine core calls every step) to
        follow the requests it is given: arrivals, finishes and generated tokens, and from then on record
        each finished request's per-token weight versions (`take_sampled`)."""
        if "execute_model" in vars(self):
            return
        self.finished_requests, self.updates_applied, self.hold = 0, 0, None
        self.sampling: dict[str, Sampling] = {}
        self.sampled: list[dict] = []
        self.held: dict[str, int] = {}  # the requests the engine held: their tokens when it paused
        self.policy_steps_by_update: list[int | None] = [None]  # update 0: the weights the engine loaded
        step, sample = self.execute_model, self.sample_tokens

        def execute_model(scheduler_output, *args, **kwargs):
            self._follow(scheduler_output)
            return step(scheduler_output, *args, **kwargs)

        def sample_tokens(*args, **kwargs):
            output = sample(*args, **kwargs)
            self._hold_if_ready()
            return output

        self.execute_model, self.sample_tokens = execute_model, sample_tokens

    def take_sampled(self) -> list[dict]:
        """The requests finished since the last call, as the engine sampled them: id, context, generated
        tokens, per token the weight updates applied before it and the policy's optimizer steps those
        weights had seen, and the tokens it had when the engine held it for an update (or None). Includes
        those the scheduler has finished but not yet told this worker of (it does at the next step)."""
        for request in engine_core().scheduler.finished_req_ids:
            self._sampled(request, self.model_runner.requests.get(request))
        taken, self.sampled = self.sampled, []
        return taken

    def _follow(self, scheduler_output) -> None:
        # the model runner's state of each request (a new one's is added, a finished one's dropped, in this step)
        running = self.model_runner.requests
        finished = scheduler_output.finished_req_ids
        self.finished_requests += len(finished)
        for request in finished:
            self._sampled(request, running.get(request))
        for new in scheduler_output.scheduled_new_reqs:
            self.sampling[new.req_id] = Sampling(self.updates_applied)
        hold = self.hold
        if hold is None or hold.paused:
            return
        if self.finished_requests >= hold.after_finished:
            for new in scheduler_output.scheduled_new_reqs:
                if not hold.candidates:
                    hold.updates_at_arrival = self.updates_applied
                hold.candidates.append(new.req_id)
        if hold.candidates and self.updates_applied != hold.updates_at_arrival:
            self.hold = None  # an update landed while they ran
            return
        hold.candidates = [r for r in hold.candidates if r not in finished]

    def _hold_if_ready(self) -> None:
        """After a step's sampling: pause the engine for the first candidate with its tokens that goes on."""
        hold = self.hold
        if hold is None or hold.paused:
            return
        running = self.model_runner.requests
        for request in hold.candidates:
            state = running.get(request)
            if state is not None and len(state.output_token_ids) >= hold.at_tokens and self._goes_on(state):
                self.engine_core = engine_core()
                self.engine_core.pause_scheduler(mode="keep", clear_cache=False)
                hold.paused = True
                self.held[request] = len(state.output_token_ids)
                return

    def _goes_on(self, state) -> bool:
        """Whether the scheduler will keep a request running after the token it just sampled (vLLM's
        `check_stop`, read conservatively: any end-of-sequence id the model or request names stops it)."""
        params, tokens = state.sampling_params, state.output_token_ids
        if params is None or len(tokens) >= (params.max_tokens or 0):
            return False
        if len(state.prompt_token_ids or []) + len(tokens) >= self.model_runner.max_model_len:
            return False
        hf_eos = getattr(self.model_runner.model_config.hf_config, "eos_token_id", None)
        stops = set(params.all_stop_token_ids) | set(params.stop_token_ids or [])
        stops |= {params.eos_token_id} | set(hf_eos if isinstance(hf_eos, list) else [hf_eos])
        return tokens[-1] not in stops

    def _sampled(self, request: str, state) -> None:
        sampling = self.sampling.pop(request, None)
        if sampling is None or state is None:  # arrived before the watch began
            return
        tokens = list(state.output_token_ids)
        updates = sampling.versions(len(tokens))
        record = {
            "engine": os.environ.get(ENGINE_ID_ENV), "request": request, "context": list(state.prompt_token_ids or []),
            "tokens": tokens, "updates": updates, "policy_steps": [self.policy_steps_by_update[u] for u in updates],
            "held_at": self.held.get(request),
        }
        self.sampled.append(record)
        directory = os.environ.get(RECORD_DIR_ENV)
        if directory:  # the rehearsals read every engine's requests back
            path = Path(directory) / "generation" / f"engine-{os.environ.get(ENGINE_ID_ENV)}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def _updated(self) -> None:
        """An update was applied between two steps: every running request's tokens so far were the old weights'."""
        if not hasattr(self, "sampling"):
            return
        self.updates_applied += 1
        self.policy_steps_by_update.append(LOADED_POLICY_STEPS[0] if LOADED_POLICY_STEPS else None)
        for request, sampling in self.sampling.items():
            state = self.model_runner.requests.get(request)
            sampling.tokens_at_update.append(len(state.output_token_ids) if state is not None else 0)

    def update_weights_via_ipc_zmq(self) -> bool:
        """What NeMo-RL's workers call for a refit. Its CUDA-IPC/ZMQ stream from the trainer is replaced by
        a safetensors file a trainer in the test's process writes first (REFIT_FILE_ENV), or else by the
        newest weights the Megatron policy workers posted (tests/support/refit_mailbox.py, waiting for
        them: upstream's stream and update run at once). The weights end, as upstream's do, in vLLM's own
        `model.load_weights`. A held request is released either way (a failed update must not leave the
        engine paused)."""
        try:
            self._load_the_refit()
        finally:
            self._release_the_hold()
        self._updated()
        return True

    def _load_the_refit(self) -> None:
        if os.environ.get(REFIT_FILE_ENV):
            from safetensors import safe_open
            from safetensors.torch import load_file

            weights = load_file(os.environ[REFIT_FILE_ENV])
            with safe_open(os.environ[REFIT_FILE_ENV], "pt") as f:  # written from the mailbox: its steps too
                steps = (f.metadata() or {}).get("policy_steps")
            LOADED_POLICY_STEPS[:] = [int(steps)] if steps is not None else []
        else:
            from tests.support.refit_mailbox import take_newer

            self.refit_version, weights, steps = take_newer(getattr(self, "refit_version", 0))
            LOADED_POLICY_STEPS[:] = [steps]
        report = self.load_trainer_weights(list(weights.items()))
        unloaded = set(report["parameters"]) - set(report["loaded"])
        if unloaded:  # a stale parameter would serve the old weights' log-probs
            raise RuntimeError(f"the refit left these engine parameters as they were: {sorted(unloaded)}")

    def _release_the_hold(self) -> None:
        hold = getattr(self, "hold", None)
        if hold is not None and hold.paused:
            self.hold = None
            self.engine_core.resume_scheduler()

    def prepare_refit_info(self, state_dict_info: dict) -> None:
        """Upstream keeps the names, shapes and dtypes its CUDA-IPC/NCCL stream is unpacked by; the file
        names its own tensors."""

    def init_collective(self, rank_prefix: int, ip: str, port: int, world_size: int, train_world_size: int) -> None:
        """Upstream joins an NCCL group with the training ranks for non-colocated refits: the file replaces it."""

    def update_weights_from_collective(self) -> bool:
        """The non-colocated refit (upstream: an NCCL broadcast from the training ranks): the same file."""
        return self.update_weights_via_ipc_zmq()

    def cleanup(self) -> None:
        """Upstream closes its ZMQ socket at shutdown: there is none here."""

    def load_trainer_weights(self, weights: list[tuple[str, torch.Tensor]]) -> dict:
        """The end of NeMo-RL's refit (`VllmInternalWorkerExtension._load_weights`, after its CUDA-IPC/NCCL
        transport): the trainer's (name, tensor) pairs into vLLM's own `model.load_weights`. Returns the
        parameter names vLLM reports loaded, the model's own parameter names, and its map from fused
        parameters to the trainer's parts (qkv_proj -> q_proj, k_proj, v_proj)."""
        model = self.model_runner.model
        loaded = model.load_weights(weights=iter(weights))
        return {
            "loaded": sorted(loaded),
            "parameters": sorted(name for name, _ in model.named_parameters()),
            "packed": {k: list(v) for k, v in getattr(model, "packed_modules_mapping", {}).items()},
        }
