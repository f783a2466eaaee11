"""The installed NeMo-RL where its releases differ (v0.7.0, main): the one module that decides.

Each difference is decided by what the installed `nemo_rl` has (a type, a signature, a declared key, an
attribute, a probe), never by a version string: main's snapshot of 2026-08-22 still says 0.6.0. The rest
of the adapter calls these functions and reads as if there were one NeMo-RL; docs/nemo_rl.md ("NeMo-RL
versions") lists each difference and how it is decided. Every nemo_rl import is inside a function.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Mapping, MutableMapping
from contextlib import nullcontext
from typing import Any

# NeMo-RL trees this adapter is tested against (tests/suite.sh runs the NeMo-RL tests on each).
TESTED_NEMO_RL = "v0.7.0 (nvcr.io/nvidia/nemo-rl:v0.7.0) and main of 2026-08-22 (commit 7ea279a)"

# Validation sampling keys main requires, and the training key each defaults to here: what v0.7.0 did
# (validation sampled with the training settings) and what NeMo-RL's own example sets
# (`val_temperature: ${.temperature}`, examples/configs/grpo_math_1B.yaml).
VALIDATION_SAMPLING = {"val_temperature": "temperature", "val_top_p": "top_p", "val_top_k": "top_k"}


def version_line() -> str:
    """`NeMo-RL <version> (<where it is imported from>)` for messages about the installed NeMo-RL."""
    try:
        import nemo_rl
    except ImportError:
        return "NeMo-RL (not importable)"
    where = getattr(nemo_rl, "__file__", None) or "?"
    return f"NeMo-RL {getattr(nemo_rl, '__version__', '?')} ({where.rsplit('/', 2)[0]})"


def grpo_settings(master_config: Any) -> dict[str, Any]:
    """`master_config.grpo` as a plain dict, whichever type the installed MasterConfig gives it."""
    section = master_config.grpo if hasattr(master_config, "grpo") else master_config["grpo"]
    if isinstance(section, Mapping):
        return dict(section)
    return section.model_dump()


def async_settings(master_config: Any) -> dict[str, Any] | None:
    """`grpo.async_grpo` when enabled, else None."""
    block = grpo_settings(master_config).get("async_grpo") or {}
    return dict(block) if block.get("enabled") else None


def save_state_value(state: Any, key: str) -> Any:
    """One field of setup()'s GRPOSaveState (a dict on v0.7.0, a dataclass on main)."""
    return state[key] if isinstance(state, Mapping) else getattr(state, key)


def loss_fn_kwargs(setup_loss_fn: Any) -> dict[str, Any]:
    """The keyword arguments `setup()` built its ClippedPGLossFn with, besides the config: every extra
    parameter of the installed `ClippedPGLossFn.__init__`, read off that instance (main sets
    `use_fused_linear_logprobs` from the Megatron config; v0.7.0 has none)."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn

    parameters = list(inspect.signature(ClippedPGLossFn.__init__).parameters.values())[2:]  # self, cfg
    missing = [p.name for p in parameters if not hasattr(setup_loss_fn, p.name) and p.default is p.empty]
    if missing:
        raise RuntimeError(
            f"{version_line()}: ClippedPGLossFn.__init__ requires {', '.join(missing)}, which setup()'s loss "
            f"does not keep as attributes; BAPOLossFn cannot be built like it. Tested: {TESTED_NEMO_RL}"
        )
    return {p.name: getattr(setup_loss_fn, p.name) for p in parameters if hasattr(setup_loss_fn, p.name)}


def required_generation_keys() -> frozenset[str]:
    """Keys the installed NeMo-RL's GenerationConfig requires (validated by MasterConfig)."""
    from nemo_rl.models.generation.interfaces import GenerationConfig

    return frozenset(getattr(GenerationConfig, "__required_keys__", ()))


def fill_validation_sampling(config: MutableMapping, required: frozenset[str]) -> list[str]:
    """Give `policy.generation` the validation sampling keys the installed NeMo-RL requires and the config
    leaves out, each equal to its training key. Returns `key=value (from <training key>)` per key set."""
    generation = (config.get("policy") or {}).get("generation")
    if not isinstance(generation, MutableMapping):
        return []
    filled = []
    for key, source in VALIDATION_SAMPLING.items():
        if key in required and key not in generation and source in generation:
            generation[key] = generation[source]
            filled.append(f"policy.generation.{key}={generation[key]!r} (from {source})")
    return filled


def checkpointer_scope(checkpointer: Any):
    """`with` this around the train loop: main's CheckpointManager flushes its background finalisation on
    exit (upstream's run_grpo.py does the same); v0.7.0's finalises synchronously and is no context."""
    return checkpointer if hasattr(checkpointer, "__enter__") else nullcontext(checkpointer)


def validation_early_stop(master_config: Any, val_metrics: Mapping | None) -> str | None:
    """NeMo-RL's own stop message when these validation metrics met `grpo.stop_at_validation_metric`
    (main ends its loops there); None where the installed NeMo-RL has no such stop or it was not met."""
    from nemo_rl.algorithms import grpo

    decide = getattr(grpo, "_validation_early_stop_message", None)
    settings = grpo_settings(master_config)
    metric = settings.get("stop_at_validation_metric")
    if decide is None or metric is None or not val_metrics or metric not in val_metrics:
        return None
    return decide(dict(val_metrics), settings.get("stop_at_validation_threshold"), metric)


def packed_loss_needs_full_width() -> bool:
    """Whether the installed NeMo-RL's fused packed loss input fails when FP8 padding has grown a bin's last
    sequence past the batch's width (v0.7.0; packing.py widens the batch then) or copies only its real
    tokens (main, #3182: no widening needed). Decided by running upstream's own `_pack_input_ids` on a 1 x 4
    batch whose packed sequence claims 6 tokens. Where that private function is gone, True: the widening
    is correct with or without the fix (seams.py lists this probe)."""
    import torch

    try:
        from nemo_rl.algorithms.loss.utils import _pack_input_ids
    except ImportError:
        return True
    try:
        _pack_input_ids(torch.zeros(1, 4, dtype=torch.long), torch.tensor([0, 6]), torch.tensor([0, 8]))
    except RuntimeError:
        return True
    return False


def async_collects_before_first_refit() -> bool:
    """Whether the installed `async_grpo_train` starts its trajectory collector before its first refit.
    NeMo-RL trains with vLLM's `load_format: dummy` (random weights until a refit), so there (v0.7.0) the
    first requests sample random weights; main refits first ("Generation must hold the policy's real
    weights before any backend starts collecting"). Read from the order of the two calls in the source."""
    from nemo_rl.algorithms import grpo

    return collects_before_refit(inspect.getsource(grpo.async_grpo_train))


def collects_before_refit(source: str) -> bool:
    """In `source` (a function), the first `*.start_collection.remote(...)` call comes before the first
    `refit_policy_generation(...)`. Where either is not found, True: the driver's extra refit is then
    harmless (one weight transfer)."""
    first: dict[str, int] = {}
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Call):
            callee = ast.unparse(node.func)
            for name in ("start_collection.remote", "refit_policy_generation"):
                if callee == name or callee.endswith("." + name):
                    first[name] = min(first.get(name, node.lineno), node.lineno)
    if len(first) < 2:
        return True
    return first["start_collection.remote"] < first["refit_policy_generation"]
