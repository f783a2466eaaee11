"""Test-only: lets NeMo-RL v0.7.0's Megatron worker code run on CPU processes over gloo.

`install()` is called first thing in every process that runs that code (the CPU Megatron policy workers
of tests/support/nemo_megatron_standins.py, the gloo harness of tests/nemo_rl/test_megatron_rehearsal.py). It is
never installed at interpreter start-up: other tests, and `bapo-nemo export`'s check for Megatron-Bridge,
see the machine as it is. What it replaces, and why:

1. CUDA on CPU. NeMo-RL's worker and megatron-core put tensors on the GPU by hand on the training path:
   `.cuda()` (megatron/data.py:657, model_utils.py:1365), `.to("cuda")` (batched_data_dict.py:853 via
   megatron/data.py:116), `device="cuda"` (megatron_policy_worker.py:563, train.py:761, mcore
   schedules.py), `device=torch.cuda.current_device()` (mcore DDP buffers, Bridge's reductions) and
   `pin_memory` (model_utils.py:1363, mcore's CPU offload), and mcore's optimizers accept only parameters
   whose `Tensor.type()` is a `torch.cuda.*Tensor`. Here the CPU *is* the device: those calls keep the
   tensor on the CPU and `type()` names CPU tensors as the device's. `pin_memory()` still returns a copy, as it does on a GPU machine (mcore's
   `offload_to_cpu` frees the original storage right after). The module attributes are patched rather
   than a TorchFunctionMode pushed, because torch switches modes off inside autograd's backward, where
   `AllGatherCPTensor.backward` makes its index tensor with `pin_memory=True` and `.cuda()`.
   megatron-core's checkpoint writer starts its results-queue Manager with "spawn" (safe beside CUDA
   state); on CPU it is forked (`_forked_write_results_queue`).
   `torch.cuda.*` queries answer for one CPU "device" (index 0, NVML-free memory figures), its random
   state is the CPU generator's (megatron-core's RNG tracker), and NVTX profiling ranges
   (`nemo_rl.utils.nsys.wrap_with_nvtx_name`) are no-ops.
2. `megatron.bridge`. Megatron-Bridge needs Transformer Engine to import, and its PyPI release pins
   transformers < 5 (NeMo-RL v0.7.0 needs 5.8), so it cannot be installed here. The worker module imports
   it at module top; every name resolves to a placeholder class that raises when used, except the few
   functions the worker's real methods call on this path, which act on Megatron's real process groups and
   real distributed checkpoints (see `_BRIDGE_FUNCTIONS`):
   `get_pg_collection`, `logical_and_across_model_parallel_group`,
   `reduce_max_stat_across_model_parallel_group`, `get_rank_safe`, `save_checkpoint`,
   `maybe_finalize_async_save`, and the load the worker's `__init__` does (`load_checkpoint`).
3. megatron-core 0.19.2 (the newest release) against the newer Megatron-LM commit NeMo-RL main pins: the
   Megatron-FSDP adapter classes main's worker imports for its isinstance checks become placeholders (the
   rehearsal's model is DDP-wrapped).
4. Start-up only: wandb, mlflow and swanlab, imported at the top of NeMo-RL's logger module (and
   megatron-core's timers) but never called by a policy worker, load on first use instead of at import
   (~3 CPU-s of each of a rehearsal's 16 worker start-ups). A use loads the real package.
5. Start-up only: megatron-core puts its weights-only loader in `torch.storage._load_from_bytes`, so a
   tensor pickled in a process that imported it names `megatron.core.safe_globals`, and every process
   that unpickles one imported megatron-core: each generation worker, at the driver's first batch (~6
   CPU-s each, on the first step's path). The loader is pickled under torch's own name instead
   (`pickled_under_torchs_name`): a receiver with megatron-core imported still loads with it, one
   without loads as it would had the sender never imported megatron-core.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

_INSTALLED = False


# ---- 1. CUDA on CPU -----------------------------------------------------------------------------------
def _on_cpu(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # an int device is a CUDA ordinal (torch.cuda.current_device())
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _factory(fn):
    @functools.wraps(fn)
    def on_cpu(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return on_cpu


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            args = (_on_cpu(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _tensor_type(original):
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)  # "torch.FloatTensor" for a CPU tensor
        return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name

    return type_


def _cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _pin_memory(self, device=None):
    return self.clone()  # a host copy, as on a GPU machine


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "eye", "linspace",
)


class _InOrderStream:
    """`torch.cuda.current_stream()` on the CPU "device": work runs in program order, so there is nothing
    to wait for (megatron-core 0.19's grad buffers wait on the current stream before reducing)."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event=None):
        return event


_STREAM = _InOrderStream()


def _install_cuda_on_cpu() -> None:
    for name in _FACTORIES:
        setattr(torch, name, _factory(getattr(torch, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.cuda = _cuda
    torch.Tensor.type = _tensor_type(torch.Tensor.type)
    torch.Tensor.pin_memory = _pin_memory
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.get_device_name = lambda device=None: "CPU (CUDA stand-in)"
    cuda.mem_get_info = lambda device=None: (8 << 30, 16 << 30)
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.current_stream = lambda device=None: _STREAM
    cuda.nvtx.range_push = lambda msg: 0  # NeMo-RL's wrap_with_nvtx_name profiling ranges
    cuda.nvtx.range_pop = lambda: 0


def _cuda_rng_is_the_cpu_generator() -> None:
    """megatron-core's RNG tracker (`model_parallel_cuda_manual_seed`, and the `fork()` around attention
    and dropout in its GPTModel's layers) keeps named CUDA generator states: on CPU they are the CPU
    generator's states. Its own setter goes through `torch.cuda._lazy_call`, which without CUDA queues the
    call for a CUDA initialisation that never comes, so the state would silently never be set."""
    from megatron.core.tensor_parallel import random as mcore_random

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(seed: int) -> None:
        # a function of its own: torch.compile's rule table (megatron-core's fusions compile at import)
        # refuses one object under two torch names
        torch.manual_seed(seed)

    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = get_rng_state
    torch.cuda.manual_seed = torch.cuda.random.manual_seed = manual_seed
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


# ---- 2. megatron.bridge --------------------------------------------------------------------------------
class _Placeholder(type):
    """A Megatron-Bridge name this CPU path does not use: importable, fails loudly when used."""

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(
            f"{cls.__module__}.{cls.__name__} is Megatron-Bridge's (GPU image only); the CPU rehearsal does "
            "not run it"
        )


def _placeholder(module: str, name: str) -> type:
    return _Placeholder(name, (), {"__module__": module})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `megatron.bridge` (and its submodules) as stubs."""

    def __init__(self, prefixes: tuple[str, ...], functions: dict[str, dict]):
        self.prefixes, self.functions = prefixes, functions

    def find_spec(self, fullname, path, target=None):
        if any(fullname == p or fullname.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        for name, fn in self.functions.get(module.__name__, {}).items():
            setattr(module, name, fn)


def get_pg_collection(model):
    """Bridge's `training.utils.pg_utils.get_pg_collection`: the model's process groups, else Megatron's
    global (mpu) groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    ref = model[0] if isinstance(model, list) else model
    while ref is not None:
        if getattr(ref, "pg_collection", None) is not None:
            return ref.pg_collection
        ref = getattr(ref, "module", None)
    return ProcessGroupCollection.use_mpu_process_groups()


def reduce_max_stat_across_model_parallel_group(stat, mp_group):
    """Bridge's `train_utils.reduce_max_stat_across_model_parallel_group`: max over the group, None
    where every rank had None."""
    value = torch.tensor([-1.0 if stat is None else float(stat)], dtype=torch.float32)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=mp_group)
    return None if value.item() == -1.0 else value.item()


def logical_and_across_model_parallel_group(input, mp_group):  # Bridge's signature (input)
    """Bridge's `train_utils.logical_and_across_model_parallel_group`."""
    value = torch.tensor([1 if input is True else 0], dtype=torch.int)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=mp_group)
    return bool(value.item())


def get_rank_safe() -> int:
    """Bridge's `utils.common_utils.get_rank_safe`."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


# Megatron-Bridge's checkpoint directory layout (training/checkpointing.py): <save>/iter_NNNNNNN/ with the
# torch_dist files, and <save>/latest_checkpointed_iteration.txt naming the newest iteration.
TRACKER_FILE = "latest_checkpointed_iteration.txt"


def _iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


# Bridge's `_build_sharded_state_dict_metadata` for the distributed optimizer in torch_dist format (its
# default: not fully reshardable).
SHARDED_STATE_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


def training_state_dict(model, optimizer, opt_param_scheduler, is_loading: bool = False) -> dict:
    """Bridge's `generate_state_dict` for one model chunk in torch_dist format: the model's sharded state
    dict (TP-sharded tensors), the distributed optimizer's (built from it), the LR scheduler's plain state."""
    state = {"checkpoint_version": 3.0, "model": model.sharded_state_dict(metadata=SHARDED_STATE_METADATA)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=SHARDED_STATE_METADATA
        )
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    return state


def save_checkpoint(
    state,
    model,
    optimizer,
    opt_param_scheduler,
    num_floating_point_operations_so_far,
    checkpointing_context=None,
    **_: Any,
):
    """Bridge's `training.checkpointing.save_checkpoint` for one model chunk, through megatron-core's
    own distributed checkpointing (torch_dist format), into Bridge's directory layout."""
    from megatron.core import dist_checkpointing

    iteration = int(state.train_state.step)
    target = _iteration_dir(state.cfg.checkpoint.save, iteration)
    if torch.distributed.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    from megatron.core.utils import unwrap_model

    (chunk,) = unwrap_model(model)  # Bridge saves the bare model (no DDP / Float16Module wrapper)
    sharded = training_state_dict(chunk, optimizer, opt_param_scheduler)
    sharded["iteration"] = iteration
    sharded["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
    _forked_write_results_queue()
    save_root = Path(state.cfg.checkpoint.save)

    def write_tracker() -> None:  # the checkpoint is complete: name it the newest (rank 0, as Bridge)
        if torch.distributed.get_rank() == 0:
            (save_root / TRACKER_FILE).write_text(str(iteration))

    if getattr(state.cfg.checkpoint, "async_save", False):
        # Bridge's async save: megatron-core writes in a process of its own and calls the finalize functions
        # on every rank once all writes are done, when the caller finalizes (maybe_finalize_async_save).
        request = dist_checkpointing.save(sharded, str(target), async_sharded_save=True, async_strategy="mcore")
        request.add_finalize_fn(write_tracker)
        _async_calls().schedule_async_request(request)
        return
    dist_checkpointing.save(sharded, str(target))
    torch.distributed.barrier()
    _legacy_common_file(target)
    write_tracker()
    torch.distributed.barrier()


def _legacy_common_file(iteration_dir: Path) -> None:
    """`common.pt` beside a torch_dist checkpoint, where the installed NeMo-RL looks for it. The Megatron-LM
    NeMo-RL v0.7.0 pins keeps a checkpoint's common (non-sharded) state in that file, and v0.7.0's
    `CheckpointManager.get_resume_paths` finds the optimizer state by reading it; megatron-core 0.17+
    embeds it in the checkpoint instead, which NeMo-RL main reads (`_load_megatron_common_state_dict`).
    Both load either layout (megatron-core's `load_common_state_dict`)."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from nemo_rl.utils import checkpoint as nemo_checkpoint

    if hasattr(nemo_checkpoint, "_load_megatron_common_state_dict") or torch.distributed.get_rank() != 0:
        return
    if (iteration_dir / "common.pt").exists():  # megatron-core 0.16 writes it itself
        return
    torch.save(load_common_state_dict(str(iteration_dir)), iteration_dir / "common.pt")


def _forked_write_results_queue() -> None:
    """megatron-core's torch_dist writer collects its write results through a `multiprocessing` Manager
    it starts with "spawn" (filesystem_async.py:54): a fresh interpreter, which a process holding CUDA
    state needs, and which here imports the Ray worker's modules again (~4 CPU-s per rank per save, 16
    times a rehearsal). A CPU process can fork it: the same Manager and queue, made once per process
    before megatron-core would make its own. (The writer processes themselves are forked by
    megatron-core as on a GPU machine.)"""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("fork"))
        manager.start(_die_with_parent)
        filesystem_async._results_queue = manager.Queue()


def _die_with_parent() -> None:
    """A forked child holds its parent's sockets, Ray's among them: while it lives, Ray does not see the
    worker die (the fault rehearsal kills workers). It ends with its parent, as a spawned one would be
    cut off."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


_ASYNC_CALLS: list = []


def _async_calls():
    """This process's queue of async checkpoint writes (Bridge keeps one on its global state)."""
    if not _ASYNC_CALLS:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        _ASYNC_CALLS.append(AsyncCallsQueue())
    return _ASYNC_CALLS[0]


def maybe_finalize_async_save(global_state, ckpt_cfg=None, blocking=False, terminate=False):
    """Bridge's async-save finaliser: megatron-core finishes the pending writes (waiting for them when
    `blocking`) and runs their finalize functions on every rank; nothing pending after a synchronous save."""
    if _ASYNC_CALLS:
        _ASYNC_CALLS[0].maybe_finalize_async_calls(blocking=blocking)
        if terminate:
            _ASYNC_CALLS.pop().close()


def checkpoint_exists(path) -> bool:
    """Bridge's `checkpoint_exists`: the tracker file is there."""
    return path is not None and (Path(path) / TRACKER_FILE).exists()


def load_checkpoint(state, model, optimizer, opt_param_scheduler, checkpointing_context=None, **_: Any):
    """Bridge's `load_checkpoint` for one model chunk: the newest iteration under
    `state.cfg.checkpoint.load`, through megatron-core's distributed checkpointing."""
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    root = state.cfg.checkpoint.load
    iteration = int((Path(root) / TRACKER_FILE).read_text().strip())
    (chunk,) = unwrap_model(model)
    if optimizer is not None:
        # Without Apex/TE, megatron-core's DistributedOptimizer.state_dict reads Adam's step from the
        # state, which a fresh optimizer lacks: fill it as megatron-core does for its FSDP loads (the
        # values are overwritten by the load below).
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            if not part.optimizer.state:
                part._init_optimizer_states_with_dummy_values()
    sharded = training_state_dict(chunk, optimizer, opt_param_scheduler, is_loading=True)
    loaded = dist_checkpointing.load(sharded, str(_iteration_dir(root, iteration)))
    chunk.load_state_dict(loaded["model"])
    if optimizer is not None:
        # With float32 parameters (the CPU rehearsal's precision) the distributed optimizer's main params
        # are views of the model's leaf parameters, which it copies into in place; under bf16 (the
        # cluster's) they are separate fp32 copies. no_grad lets that in-place load happen on views.
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_step(optimizer, loaded["optimizer"])
    if opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    state.train_state.step = iteration
    return iteration


def _restore_adam_step(optimizer, loaded: dict) -> None:
    """megatron-core's torch-optimizer fallback (no Apex/TE, i.e. CPU) keeps Adam's step per parameter,
    and the dp_reshardable load copies every per-parameter state entry from the checkpoint's parameter
    state, in which the scalar step is not stored: the step restored from the param groups is
    overwritten with the fresh state's (1). TE's FusedAdam (GPU) keeps the step in the param groups only,
    so it is restored there. Put the checkpoint's step back into every parameter's state."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    groups = loaded["optimizer"]["param_groups"] if len(parts) == 1 else None
    for part in parts:
        saved = groups if groups is not None else part.state_dict()["optimizer"]["param_groups"]
        (step,) = {g["step"] for g in saved}
        for state in part.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(step), dtype=state["step"].dtype)


_BRIDGE_FUNCTIONS = {
    "megatron.bridge.training.utils.pg_utils": {"get_pg_collection": get_pg_collection},
    "megatron.bridge.training.utils.train_utils": {
        "logical_and_across_model_parallel_group": logical_and_across_model_parallel_group,
        "reduce_max_stat_across_model_parallel_group": reduce_max_stat_across_model_parallel_group,
    },
    "megatron.bridge.utils.common_utils": {"get_rank_safe": get_rank_safe},
    "megatron.bridge.training.checkpointing": {
        "save_checkpoint": save_checkpoint,
        "maybe_finalize_async_save": maybe_finalize_async_save,
        "checkpoint_exists": checkpoint_exists,
        "load_checkpoint": load_checkpoint,
    },
}


# ---- 3. megatron-core 0.19.2 vs NeMo-RL main's Megatron-LM ------------------------------------------------
# Names main's Megatron worker imports from a Megatron-LM newer than megatron-core 0.19.2, the newest release.
_MISSING_MCORE_NAMES = {
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter": ("FullyShardedDataParallelV1", "FullyShardedDataParallelV2"),
}


# ---- 4. start-up ------------------------------------------------------------------------------------------
_LOADED_ON_FIRST_USE = ("wandb", "mlflow", "swanlab")


class _ModuleLoadedOnFirstUse(importlib.util._LazyModule):
    """importlib's lazy module, except that reading what names the module is not a use: a second `import
    wandb` elsewhere reads `__spec__` (is it still initialising?), and `inspect.getmodule`, which torch's
    operator registration calls, reads every loaded module's `__class__` and `__file__`. Any other attribute
    hands the module back to importlib's own lazy loading (on Python 3.13 that checks for its exact class)."""

    def __getattribute__(self, attr):
        if attr == "__class__":
            return object.__getattribute__(self, attr)
        if attr in ("__spec__", "__name__", "__file__"):
            names = object.__getattribute__(self, "__dict__")
            if attr in names:
                return names[attr]
            raise AttributeError(attr)
        object.__setattr__(self, "__class__", importlib.util._LazyModule)
        return importlib.util._LazyModule.__getattribute__(self, attr)


class _LoaderOnFirstUse(importlib.util.LazyLoader):
    def exec_module(self, module):
        super().exec_module(module)
        module.__class__ = _ModuleLoadedOnFirstUse


class _OnFirstUseFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _LOADED_ON_FIRST_USE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderOnFirstUse(spec.loader)
        return spec


def install() -> None:
    """Install all four (idempotent). Call before importing NeMo-RL's Megatron modules."""
    global _INSTALLED
    if _INSTALLED:
        return
    _install_cuda_on_cpu()
    sys.meta_path.insert(0, _OnFirstUseFinder())
    sys.meta_path.insert(0, _StubFinder(("megatron.bridge",), _BRIDGE_FUNCTIONS))
    for module_name, names in _MISSING_MCORE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, _placeholder(module_name, name))
    _cuda_rng_is_the_cpu_generator()  # imports megatron-core: after the finders (item 4's lazy modules)
    pickled_under_torchs_name()
    _INSTALLED = True


def pickled_under_torchs_name() -> None:
    """megatron-core's `torch.storage._load_from_bytes` pickled by that name (item 5)."""
    import torch.storage

    loader = torch.storage._load_from_bytes
    if loader.__module__.startswith("megatron."):
        loader.__module__, loader.__qualname__ = "torch.storage", "_load_from_bytes"
