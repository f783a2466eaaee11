"""The reward your own data is graded with (`data.reward`): NeMo-RL's math grading (`math_verify`), the
bundled tasks' exact match (`arithmetic`), or a function of your own named `module:function`, imported
from the current directory or the Python path. A function of your own is called as TRL's `GRPOTrainer`
calls its `reward_funcs` (`f(prompts, completions, **columns) -> list[float]`), one completion at a time,
and must return finite numbers; docs/embedded.md ("A reward of your own") has the contract.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

from bapo_nemo.embedded.data.tasks import Task, reward
from bapo_nemo.embedded.data.user_data import DataError, math_verify_reward

Score = Callable[[str, Task], float]  # (response text, task) -> reward


def reward_function(name: str, answer_column: str) -> Score:
    """The `score(response text, task)` that `data.reward` names. A `module:function` that cannot be
    imported is an error naming it (DataError, before training starts)."""
    if name == "math_verify":
        return lambda text, task: math_verify_reward(text, task.answer)
    if name == "arithmetic":
        return reward
    fn = _import(name)

    def score(text: str, task: Task) -> float:
        out = fn(prompts=[task.question], completions=[text], **{answer_column: [task.answer]})
        return _one_reward(name, out)

    return score


def _import(name: str) -> Callable[..., Any]:
    module_name, attr = name.split(":")
    if os.getcwd() not in sys.path:  # `bapo-nemo train` runs from a console script: look beside the user
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise DataError(
            f"data.reward={name}: cannot import module {module_name!r} ({exc}); it must be importable "
            "from the current directory or the Python path"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise DataError(f"data.reward={name}: {module.__file__} has no function {attr!r}")
    return fn


def _one_reward(name: str, out: Any) -> float:
    """The single reward of a one-completion call; anything else is an error naming the function."""
    if not isinstance(out, (list, tuple)) or len(out) != 1:
        raise DataError(
            f"data.reward={name} returned {out!r} for one completion: return a list of one reward per completion"
        )
    value = out[0]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise DataError(
            f"data.reward={name} returned the reward {value!r}: each reward must be a finite number"
        )
    return float(value)
