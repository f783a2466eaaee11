"""`granularity: step`: one set of BAPO bounds per optimizer step, chosen on the driver.

NeMo-RL calls the loss once per micro-batch, so `StepBoundsTrainer` wraps `policy.train`, searches each
optimizer step's bounds over its whole global batch and ships them in the batch (`STEP_BOUNDS_KEYS`) for
BAPOLossFn. The first step of a train() call uses grpo's `prev_logprobs` (no GPU work); each later one costs
a no-grad `get_logprobs` pass (over a `step_bounds_sample` share of the groups) and its own train() call,
so the LR scheduler ticks per optimizer step (docs/nemo_rl.md, "`granularity`").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from bapo_nemo.algorithm import ClipSearchResult, search_clip_bounds
from bapo_nemo.algorithm.bapo import importance_ratio
from bapo_nemo.algorithm.options import NemoBAPOOptions
from bapo_nemo.nemo.loss_math import importance_weights_like_nemo

STEP_BOUNDS_KEYS = (
    "bapo_c_low",
    "bapo_c_high",
    "bapo_rho",
    "bapo_rho_initial",
    "bapo_target_met",
    "bapo_steps",
)


def search_step_bounds(
    batch, current_logprobs: torch.Tensor, options: NemoBAPOOptions, loss_cfg: dict[str, Any]
) -> ClipSearchResult:
    """Bounds for one optimizer step from a whole global batch held on the driver (no collective)."""
    token_mask = batch["token_mask"][:, 1:]
    mask = token_mask * batch["sample_mask"].unsqueeze(-1)
    advantages = batch["advantages"][:, 1:]
    prev, gen = batch["prev_logprobs"][:, 1:], batch["generation_logprobs"][:, 1:]
    ref = prev if options.ratio_reference == "proximal" else gen
    ratio = importance_ratio(current_logprobs[:, 1:], ref)
    weights = None
    if loss_cfg.get("use_importance_sampling_correction") and options.ratio_reference == "proximal":
        weights = importance_weights_like_nemo(
            prev,
            gen,
            token_mask,
            loss_cfg.get("truncated_importance_sampling_type"),
            loss_cfg.get("truncated_importance_sampling_ratio"),
            loss_cfg.get("truncated_importance_sampling_ratio_min"),
        )
    return search_clip_bounds(ratio, advantages, mask, options.bapo, all_reduce=None, weights=weights)


def sampled_group_rows(
    rows: int, group_size: int, fraction: float, generator: torch.Generator, row_multiple: int = 1
) -> list[int]:
    """Rows of a random sample of round(fraction x groups) whole prompt groups (at least one), in batch
    order; more groups are taken while the row count is not a multiple of `row_multiple` (v0.7.0's
    get_logprobs shards its rows evenly over the data-parallel ranks)."""
    groups = rows // group_size
    k = min(groups, max(1, round(fraction * groups)))
    while (k * group_size) % row_multiple and k < groups:
        k += 1
    picked = sorted(torch.randperm(groups, generator=generator)[:k].tolist())
    return [g * group_size + i for g in picked for i in range(group_size)]


def attach_bounds(batch, result: ClipSearchResult) -> None:
    """Per-sample copies of the step's bounds: they survive NeMo-RL's sharding and micro-batching."""
    n = batch["sample_mask"].shape[0]
    values = (
        result.c_low,
        result.c_high,
        result.rho,
        result.rho_initial,
        float(result.target_met),
        float(result.steps),
    )
    for key, value in zip(STEP_BOUNDS_KEYS, values):
        batch[key] = torch.full((n,), value, dtype=torch.float64)


def bounds_from_data(data) -> ClipSearchResult:
    """The step's bounds as BAPOLossFn sees them inside a micro-batch."""
    c_low, c_high, rho, rho0, met, steps = (float(data[k].reshape(-1)[0]) for k in STEP_BOUNDS_KEYS)
    return search_result(
        c_low=c_low, c_high=c_high, rho=rho, rho_initial=rho0, target_met=bool(met), steps=int(steps)
    )


def search_result(**known) -> ClipSearchResult:
    """A ClipSearchResult with the given fields and zero statistics for the rest (only the bounds and
    the search outcome travel from the driver to the workers)."""
    values = {f.name: 0 for f in dataclasses.fields(ClipSearchResult)}
    values.update(known)
    return ClipSearchResult(**values)


def merge_train_results(results: list[dict[str, Any]]) -> dict[str, Any]:
    """k single-step train() results -> what one k-step train() call would have returned.

    Workers divide each micro-batch metric by the number of optimizer steps of the call (except names
    with "_min"/"_max"); each split call divided by 1, so divide by k here. Losses are concatenated
    (one per optimizer step, as the unsplit call returns them); grad_norm is the last step's.
    """
    k = len(results)
    merged: dict[str, Any] = {}
    all_mb: dict[str, list] = {}
    for r in results:
        for name, values in r.get("all_mb_metrics", {}).items():
            scale = (
                1.0
                if (
                    "_min" in name
                    or "_max" in name
                    or name in ("lr", "wd", "global_valid_seqs", "global_valid_toks")
                )
                else 1.0 / k
            )
            all_mb.setdefault(name, []).extend(v * scale for v in values)
    merged.update(results[-1])
    merged["all_mb_metrics"] = all_mb
    merged["loss"] = torch.cat([torch.as_tensor(r["loss"]).reshape(-1) for r in results])
    return merged


class StepBoundsTrainer:
    """Drop-in for `policy.train` on the driver (grpo_train calls `policy.train(data, loss_fn, timer=...)`)."""

    def __init__(
        self,
        policy,
        options: NemoBAPOOptions,
        loss_cfg: dict[str, Any],
        global_batch_size: int,
        train_fn: Callable | None = None,
        group_size: int = 1,
        seed: int = 0,
    ):
        self.policy = policy
        self.options = options
        self.loss_cfg = loss_cfg
        self.global_batch_size = int(global_batch_size)
        self.train_fn = train_fn or policy.train  # the original bound method
        self.group_size = int(group_size)  # grpo.num_generations_per_prompt: consecutive rows of one prompt
        self.generator = torch.Generator().manual_seed(int(seed))  # the sampled groups
        sample = options.step_bounds_sample
        if 0 < sample < 1 and (self.group_size < 1 or self.global_batch_size % self.group_size):
            raise ValueError(
                f"loss_fn.bapo.step_bounds_sample={sample} samples whole prompt groups, but "
                f"policy.train_global_batch_size={self.global_batch_size} is not a multiple of "
                f"grpo.num_generations_per_prompt={self.group_size}: make it one, or set the sample to 0 or 1"
            )

    def step_search(self, batch, timer=None) -> ClipSearchResult:
        """The bounds of an optimizer step after the first of a rollout batch (the module docstring)."""
        sample = self.options.step_bounds_sample
        if sample == 0:
            return search_step_bounds(batch, batch["prev_logprobs"], self.options, self.loss_cfg)
        if sample < 1:
            dp = int(getattr(self.policy, "data_parallel_size", 1) or 1)
            rows = sampled_group_rows(batch.size, self.group_size, sample, self.generator, dp)
            if len(rows) < batch.size:
                batch = batch.select_indices(rows)
        current = self.policy.get_logprobs(batch, timer=timer)["logprobs"]  # the extra no-grad pass
        return search_step_bounds(batch, current, self.options, self.loss_cfg)

    def __call__(
        self,
        data,
        loss_fn,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        timer=None,
        check_dim_skip_keys=None,
    ):
        kwargs = {"mbs": mbs, "timer": timer, "check_dim_skip_keys": check_dim_skip_keys}
        if eval_mode:  # no update: one set of bounds for the whole batch, at the current weights
            attach_bounds(data, search_step_bounds(data, data["prev_logprobs"], self.options, self.loss_cfg))
            return self.train_fn(data, loss_fn, eval_mode=True, gbs=gbs, **kwargs)
        gbs = int(gbs or self.global_batch_size)
        num_steps = max(1, data.size // gbs)
        results = []
        for step in range(num_steps):
            batch = data.slice(step * gbs, (step + 1) * gbs) if num_steps > 1 else data
            if step == 0:  # prev_logprobs: the current weights, computed just before train()
                result = search_step_bounds(batch, batch["prev_logprobs"], self.options, self.loss_cfg)
            else:
                result = self.step_search(batch, timer)
            attach_bounds(batch, result)
            results.append(self.train_fn(batch, loss_fn, eval_mode=False, gbs=gbs, **kwargs))
        return results[0] if num_steps == 1 else merge_train_results(results)
