"""Per-token policy versions in async GRPO with in-flight weight updates (NeMo-RL v0.7.0 and main).

vLLM's stream says nothing of weight updates, and NeMo-RL stamps a trajectory with its starting version,
so the record is made in the generation worker: a generated subclass of whichever worker class NeMo-RL
resolves (`versioned_worker_fqn`) counts streamed tokens and `*_async` updates. On the driver,
`TokenVersions` maps refits to policy versions and logs `token_age_*` (docs/nemo_rl.md, "Metrics").
Every nemo_rl import is inside a function: generation workers import this module in their own process.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bapo_nemo.rollout.token_versions import UNKNOWN, VersionIndex, VersionTracker, token_ages

# The weight-update entry points of NeMo-RL's async vLLM worker (main adds the NCCL reshard path).
UPDATE_METHODS = (
    "update_weights_via_ipc_zmq_async",
    "update_weights_from_collective_async",
    "nccl_reshard_refit_async",
)
# What those ask the engine's workers to run (`self.llm.collective_rpc(name)`), between two engine steps.
ENGINE_UPDATE_METHODS = ("update_weights_via_ipc_zmq", "update_weights_from_collective", "nccl_reshard_refit")
_PREFIX = "TokenVersioned_"
_RECORDING = "_bapo_token_versions"


class TokenVersionsError(RuntimeError):
    """The workers' record of weight updates disagrees with the loop's refits."""


# ---- worker side ------------------------------------------------------------------------------------
def versioned_worker_fqn(base_fqn: str) -> str:
    """The name under which this module builds `base_fqn`'s recording subclass (reversible, an identifier)."""
    return f"{__name__}.{_PREFIX}{base_fqn.encode().hex()}"


def __getattr__(name: str) -> Any:
    """`TokenVersioned_<hex of the base class's FQN>`: built on first use, in whichever process asks (Ray
    imports a worker class by module and name inside the worker's own process)."""
    if not name.startswith(_PREFIX):
        raise AttributeError(name)
    cls = _versioned_class(bytes.fromhex(name[len(_PREFIX) :]).decode())
    globals()[name] = cls
    return cls


def recording_generate(generate: Callable, tracker: VersionTracker) -> Callable:
    """vLLM `AsyncLLM.generate(prompt, sampling_params, request_id, ...)` with every streamed output counted.
    Prompts without token ids (text prompts) pass through unrecorded."""

    async def generate_recorded(*args, **kwargs):
        prompt = kwargs.get("prompt", args[0] if args else None)
        request = kwargs.get("request_id", args[2] if len(args) > 2 else None)
        prompt_ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if prompt_ids is None or request is None:
            async for output in generate(*args, **kwargs):
                yield output
            return
        tracker.started(request, prompt_ids)
        last = None
        try:
            async for output in generate(*args, **kwargs):
                last = output
                tracker.streamed(request, len(output.outputs[0].token_ids))
                yield output
        finally:
            if last is not None and last.finished:
                tracker.finished(request, list(last.outputs[0].token_ids))
            else:
                tracker.abandoned(request)

    setattr(generate_recorded, _RECORDING, tracker)
    return generate_recorded


def update_and_count_generated(worker, method: str, *args, **kwargs) -> dict:
    """Run inside each of the engine's workers in place of the update `method`: the update, then the tokens
    each request the worker holds has generated, read in the same call, so no engine step falls between."""
    result = getattr(worker, method)(*args, **kwargs)
    held = getattr(getattr(worker, "model_runner", None), "requests", None)  # vLLM's per-request cache
    if held is None:
        raise TokenVersionsError(
            f"vLLM's worker {type(worker).__name__} has no model_runner.requests (its per-request state): "
            "bapo_nemo/nemo/token_versions.py cannot read which tokens a weight update split; turn "
            "grpo.async_grpo.in_flight_weight_updates off, or run a tested vLLM"
        )
    return {"result": result, "generated": {request: len(state.output_token_ids) for request, state in held.items()}}


def counting_collective_rpc(collective_rpc: Callable, tracker: VersionTracker) -> Callable:
    """vLLM `AsyncLLM.collective_rpc(method, timeout, args, kwargs)` where a weight update (a name in
    ENGINE_UPDATE_METHODS) also brings back each request's generated-token count at that moment."""

    async def collective_rpc_counted(method, timeout=None, args=(), kwargs=None):
        if not (isinstance(method, str) and method in ENGINE_UPDATE_METHODS):
            return await collective_rpc(method, timeout, args, kwargs)
        answers = await collective_rpc(update_and_count_generated, timeout, (method, *args), kwargs)
        generated: dict[str, int] = {}
        for answer in answers:  # each tensor-parallel rank holds every request
            for request, count in answer["generated"].items():
                generated[request] = max(count, generated.get(request, 0))
        tracker.generated_at_update(generated)
        return [answer["result"] for answer in answers]

    setattr(collective_rpc_counted, _RECORDING, tracker)
    return collective_rpc_counted


def _versioned_class(base_fqn: str):
    import ray

    module, name = base_fqn.rsplit(".", 1)
    actor = getattr(importlib.import_module(module), name)
    base = getattr(actor, "__ray_actor_class__", actor)  # the class behind @ray.remote

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self._token_versions = VersionTracker()
        self._record_engine()

    def _record_engine(self):
        engine = getattr(self, "llm", None)  # None on the workers of a TP group that do not own the engine
        if engine is not None and not hasattr(engine.generate, _RECORDING):
            engine.generate = recording_generate(engine.generate, self._token_versions)
            engine.collective_rpc = counting_collective_rpc(engine.collective_rpc, self._token_versions)

    async def generate_async(self, *args, **kwargs):
        self._record_engine()  # an engine rebuilt since (e.g. after a sleep) is wrapped again
        async for item in base.generate_async(self, *args, **kwargs):
            yield item

    async def take_token_versions(self) -> dict:
        return {**self._token_versions.take(), "owner": getattr(self, "llm", None) is not None}

    def update(method_name: str):
        method = getattr(base, method_name)

        async def updated(self, *args, **kwargs):
            self._token_versions.update_sent()
            try:
                ok = await method(self, *args, **kwargs)
            except BaseException:
                self._token_versions.update_failed()
                raise
            if ok:
                self._token_versions.update_applied()
            else:
                self._token_versions.update_failed()
            return ok

        updated.__name__ = method_name
        return updated

    members = {
        "__init__": __init__,
        "_record_engine": _record_engine,
        "generate_async": generate_async,
        "take_token_versions": take_token_versions,
        "__module__": __name__,
    }
    members.update({m: update(m) for m in UPDATE_METHODS if hasattr(base, m)})
    cls = type(f"{_PREFIX}{base_fqn.encode().hex()}", (base,), members)
    options = dict(getattr(actor, "_default_options", None) or {})
    return ray.remote(**options)(cls) if options else ray.remote(cls)


# ---- driver side ------------------------------------------------------------------------------------
def needs_token_versions(config: dict) -> bool:
    """Async GRPO with in-flight weight updates on vLLM: the one mode where a response crosses an update."""
    async_grpo = (config.get("grpo") or {}).get("async_grpo") or {}
    generation = (config.get("policy") or {}).get("generation") or {}
    return bool(
        async_grpo.get("enabled")
        and async_grpo.get("in_flight_weight_updates")
        and generation.get("backend", "vllm") == "vllm"
    )


class TokenVersions:
    """The driver's half (see the module docstring). `install()` before `grpo.setup()` builds the workers;
    `attach(...)` after it."""

    def __init__(self, max_trajectory_age_steps: int) -> None:
        self.max_age = int(max_trajectory_age_steps)
        self.refit_versions: list[int] = []  # the policy version each refit so far carried
        self.index = VersionIndex()
        self.trained_steps = 0
        self.start_step = 0
        self.generation = None
        self.record_path: Path | None = None

    def install(self) -> None:
        from nemo_rl.algorithms import grpo
        from nemo_rl.distributed import ray_actor_environment_registry as registry
        from nemo_rl.models.generation.vllm import vllm_generation

        resolve = vllm_generation.resolve_generation_worker_cls

        def resolve_versioned(default_cls: str, config: dict) -> str:
            base = resolve(default_cls, config)
            versioned = versioned_worker_fqn(base)
            # The subclass runs where its base runs (NeMo-RL picks the worker's venv by class name).
            registry.ACTOR_ENVIRONMENT_REGISTRY.setdefault(versioned, registry.get_actor_python_env(base))
            return versioned

        vllm_generation.resolve_generation_worker_cls = resolve_versioned
        refit = grpo.refit_policy_generation

        def refit_counted(*args, **kwargs):
            result = refit(*args, **kwargs)
            self.refit_versions.append(self.start_step + self.trained_steps)
            return result

        grpo.refit_policy_generation = refit_counted

    def attach(self, policy, policy_generation, start_step: int, log_dir: str | None) -> None:
        self.generation, self.start_step = policy_generation, int(start_step)
        self.record_path = Path(log_dir) / "token_versions.jsonl" if log_dir else None
        train = policy.train

        def train_with_token_ages(data, loss_fn, *args, **kwargs):
            if kwargs.get("eval_mode"):
                return train(data, loss_fn, *args, **kwargs)
            self.collect()
            metrics = self.step_metrics(data)
            result = train(data, loss_fn, *args, **kwargs)
            self.trained_steps += 1
            if "all_mb_metrics" in result:  # one value each: grpo sums the lists
                result = {
                    **result,
                    "all_mb_metrics": {**result["all_mb_metrics"], **{k: [v] for k, v in metrics.items()}},
                }
            return result

        policy.train = train_with_token_ages

    def collect(self) -> None:
        """Every generation worker's finished records since the last call."""
        import ray

        futures = self.generation.worker_group.run_all_workers_single_data(
            "take_token_versions", run_rank_0_only_axes=["tensor_parallel", "pipeline_parallel"]
        )
        self.add_answers(ray.get(futures))

    def add_answers(self, answers: list[dict]) -> None:
        """The workers' `take_token_versions()` answers; refuses an update count other than the refits'."""
        for taken in answers:
            if not taken["owner"]:
                continue
            if taken["updates"] != len(self.refit_versions):
                raise TokenVersionsError(
                    f"a generation worker applied {taken['updates']} weight updates where the async loop made "
                    f"{len(self.refit_versions)} refits: a weight-update path bapo_nemo/nemo/token_versions.py "
                    "does not wrap (UPDATE_METHODS) or a refit it does not count; per-token versions would be "
                    "wrong, so the run stops here. Turn grpo.async_grpo.in_flight_weight_updates off, or run a "
                    "tested NeMo-RL"
                )
            self.index.add(taken["records"])

    def policy_version(self, update_count: int) -> int:
        """An engine's update count -> the policy version its weights were. 0 updates: the weights the engine
        loaded itself (NeMo-RL trains with vLLM's load_format "dummy": random weights, not a policy); the
        driver refits before v0.7.0's loop, which would otherwise sample them until its first refit."""
        if 1 <= update_count <= len(self.refit_versions):
            return self.refit_versions[update_count - 1]
        return UNKNOWN

    def step_metrics(self, data) -> dict[str, float]:
        """The step's token ages (and its record line) from the records collected and the batch's rows."""
        trained_version = self.start_step + self.trained_steps
        input_ids, token_mask = data["input_ids"].cpu().numpy(), data["token_mask"].cpu().numpy()
        lengths = data["input_lengths"].tolist()
        rows, initial = [], 0
        for i, n in enumerate(lengths):
            counts = self.index.row_spans(input_ids[i, :n], token_mask[i, :n])
            initial += sum(length for length, count in counts if count == 0)
            rows.append([[length, self.policy_version(count)] for length, count in counts])
        # Responses the replay buffer drops as too old never match a row: forget their records.
        self.index.forget_older_than(len(self.refit_versions) - self.max_age - 2)
        if self.record_path is not None:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            with self.record_path.open("a") as f:
                f.write(json.dumps({"trained_version": trained_version, "spans": rows}) + "\n")
        generated = sum(length for row in rows for length, _ in row)
        return {
            **token_ages(rows, trained_version).metrics(),
            "token_frac_engine_initial_weights": initial / generated if generated else float("nan"),
        }
