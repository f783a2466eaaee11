"""What a whole run costs at `bapo-nemo check`'s own step estimate: `grpo.max_num_steps` steps, the
validations and checkpoint saves NeMo-RL v0.7.0's `grpo_train` makes on the way, in wall time and in
GPU-hours of the whole allocation. Left out: each attempt's start-up (Ray, model load, vLLM) and the steps
a requeue trains again."""

from __future__ import annotations

from dataclasses import dataclass

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import value
from bapo_nemo.plan.simulation.step_time import StepTimeEstimate


@dataclass(frozen=True)
class RunCost:
    steps: int
    validations: int
    saves: int
    step_s: float
    validation_s: float
    save_s: float
    gpus: int

    @property
    def seconds(self) -> float:
        return self.steps * self.step_s + self.validations * self.validation_s + self.saves * self.save_s

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.gpus / 3600.0


def validations(config: dict, steps: int) -> int:
    """grpo_train validates before step 1 with val_at_start, after every val_period-th step, and after the
    last one with val_at_end (once when both fall there)."""
    period = int(get(config, "grpo.val_period", 0) or 0)
    at_end = bool(get(config, "grpo.val_at_end", False))
    after = sum(1 for s in range(1, steps + 1) if (period > 0 and s % period == 0) or (at_end and s == steps))
    return int(bool(get(config, "grpo.val_at_start", False))) + after


def saves(config: dict, steps: int) -> int:
    """A checkpoint after every save_period-th step and after the last one."""
    if not bool(value(config, "checkpointing.enabled")):
        return 0
    period = int(get(config, "checkpointing.save_period", 0) or 0)
    return sum(1 for s in range(1, steps + 1) if s == steps or (period > 0 and s % period == 0))


def run_cost(config: dict, estimate: StepTimeEstimate, gpus: int) -> RunCost | None:
    """None when the config sets no grpo.max_num_steps."""
    steps = get(config, "grpo.max_num_steps")
    if steps is None:
        return None
    steps = int(steps)
    return RunCost(steps, validations(config, steps), saves(config, steps), estimate.step_s, estimate.validation_s,
                   estimate.save_s, gpus)


def duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 60:.0f} minutes"


def cost_line(cost: RunCost) -> str:
    return (
        f"run cost (grpo.max_num_steps {cost.steps} at this estimate; a planning figure): {cost.steps} steps x "
        f"{cost.step_s:.0f}s + {cost.validations} validations x {cost.validation_s:.0f}s + {cost.saves} saves x "
        f"{cost.save_s:.0f}s = {cost.seconds:,.0f}s ({duration(cost.seconds)}) on {cost.gpus} GPUs = "
        f"{cost.gpu_hours:,.1f} GPU-hours; each attempt's start-up and the steps a requeue repeats not included"
    )


def cost_json(cost: RunCost) -> dict:
    return {**cost.__dict__, "seconds": cost.seconds, "gpu_hours": cost.gpu_hours}
