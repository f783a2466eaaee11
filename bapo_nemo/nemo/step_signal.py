"""What a NeMo-RL training step had to learn from, logged as the embedded trainer logs it.

- `frac_reward_zero_std` (TRL's name): the share of the step's valid responses whose masked advantages are
  all 0 (their group's rewards tie), read off the train batch on the driver in every loop.
- `bapo/rho`, `bapo/rho_initial`: the loss weights them by signal tokens (A != 0); here they are divided
  by the step's signal share, or dropped without one (P / (P + N) is 0 / 0: a gap, not a 1.0).
- `warn_on_zero_spread` (the embedded `ZeroSpreadWatch`): after its run of tied steps, one warning on stderr
  and as an MLflow tag.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from bapo_nemo.embedded.loop.step_metrics import ZERO_SPREAD_TAG, ZeroSpreadWatch
from bapo_nemo.nemo.loss_math import PREFIX, SIGNAL_WEIGHTED_METRICS

ZERO_SPREAD_METRIC = "frac_reward_zero_std"


def zero_spread_share(data) -> float:
    """Share of the batch's valid samples whose advantages are 0 on every response token."""
    token_mask = data["token_mask"][:, 1:] > 0
    advantages = data["advantages"][:, 1:]
    valid = data["sample_mask"] > 0
    if not bool(valid.any()):
        return float("nan")
    tied = ~((advantages != 0) & token_mask).any(dim=-1)
    return float((tied & valid).sum()) / float(valid.sum())


def signal_weighted_shares(all_mb_metrics: dict[str, list]) -> dict[str, list]:
    """`bapo/rho*` as one value each: their summed signal-weighted parts over the summed signal share
    (pos + neg token fractions, emitted over the same denominators); absent when the step had no signal."""
    out = dict(all_mb_metrics)
    signal = sum(all_mb_metrics.get(PREFIX + "pos_token_frac", [])) + sum(
        all_mb_metrics.get(PREFIX + "neg_token_frac", [])
    )
    for name in SIGNAL_WEIGHTED_METRICS:
        key = PREFIX + name
        if key not in out:
            continue
        if signal > 0:
            out[key] = [sum(out[key]) / signal]
        else:
            del out[key]
    return out


class SignalMetricsTrainer:
    """Wraps `policy.train` on the driver (composes with StepBoundsTrainer): adds `frac_reward_zero_std`
    and turns the signal-weighted `bapo/rho*` into per-step values before grpo_train sums the lists."""

    def __init__(self, train_fn: Callable):
        self.train_fn = train_fn

    def __call__(self, data, loss_fn, *args, **kwargs) -> dict[str, Any]:
        result = self.train_fn(data, loss_fn, *args, **kwargs)
        if kwargs.get("eval_mode") or "all_mb_metrics" not in result:
            return result
        metrics = signal_weighted_shares(result["all_mb_metrics"])
        with torch.no_grad():
            metrics[ZERO_SPREAD_METRIC] = [zero_spread_share(data)]
        return {**result, "all_mb_metrics": metrics}


def warn_on_zero_spread(logger, set_tag: Callable[[str, str], None], watch: ZeroSpreadWatch | None = None):
    """Wrap `logger.log_metrics`: feed each step's train metrics to the watch; its warning goes to stderr
    and, through `set_tag`, to the MLflow run."""
    watch = watch or ZeroSpreadWatch()
    log_metrics = logger.log_metrics

    def watching(metrics, step, *args, **kwargs):
        log_metrics(metrics, step, *args, **kwargs)
        prefix = kwargs.get("prefix", args[0] if args else "")
        if prefix != "train" or ZERO_SPREAD_METRIC not in metrics:
            return
        warning = watch.update(int(step), float(metrics[ZERO_SPREAD_METRIC]), float(metrics.get("reward", "nan")))
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
            set_tag(ZERO_SPREAD_TAG, warning)

    logger.log_metrics = watching
    return watch
