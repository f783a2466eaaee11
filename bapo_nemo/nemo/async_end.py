"""Whether `async_grpo_train` ended as asked, or failed and returned.

Where the installed NeMo-RL prints the async loop's exception and returns, a crashed job would exit 0 and
look finished to Slurm. The driver records the steps the loop finished (a step's last `log_metrics` says
`step_finished=True`) and the last validation metrics; an end before `grpo.max_num_steps` is an error
unless the loop was told to stop (SIGUSR1, `checkpoint_must_save_by`, `grpo.stop_at_validation_metric`).
"""

from __future__ import annotations

from typing import Any

from bapo_nemo.nemo.installed import grpo_settings, validation_early_stop
from bapo_nemo.nemo.stop_signal import early_stop_reached


class AsyncLoopError(RuntimeError):
    """async_grpo_train returned before grpo.max_num_steps without a stop request: its loop failed."""


def check_async_loop_finished(steps_done: int, max_steps: int, validation_stop: str | None = None) -> None:
    if steps_done < max_steps and not early_stop_reached() and validation_stop is None:
        raise AsyncLoopError(
            f"async GRPO ended after step {steps_done} of {max_steps} without a stop request: NeMo-RL's "
            "async_grpo_train printed the error of its loop above and returned; fix it and rerun the same "
            "command (it resumes from the newest checkpoint)"
        )


class AsyncLoopWatch:
    """Wraps `logger.log_metrics` to record finished steps and the last validation metrics."""

    def __init__(self, logger: Any, first_step: int):
        self.finished: list[int] = [int(first_step)]
        self.last_validation: dict | None = None
        log_metrics = logger.log_metrics

        def recording(metrics, step, *args, **kwargs):
            log_metrics(metrics, step, *args, **kwargs)
            prefix = kwargs.get("prefix", args[0] if args else "")
            if prefix == "validation":
                self.last_validation = dict(metrics)
            if kwargs.get("step_finished", args[2] if len(args) > 2 else False):
                self.finished.append(int(step))

        logger.log_metrics = recording

    def check(self, master_config: Any) -> None:
        max_steps = int(grpo_settings(master_config)["max_num_steps"])
        stop = validation_early_stop(master_config, self.last_validation)
        if stop is not None:
            print(f"async GRPO ended early as configured: {stop}", flush=True)
        check_async_loop_finished(max(self.finished), max_steps, stop)
