"""BAPOLossFn: NeMo-RL's ClippedPGLossFn with BAPO's adaptive clip bounds.

Per call it searches (c_low, c_high) over the data-parallel group (`groups.py`), writes them into the
parent's clip epsilons and lets ClippedPGLossFn do the rest; with `bapo.enabled: false` it *is*
ClippedPGLossFn. Imports nemo_rl at module import: load it only where NeMo-RL is installed. It is pickled
to every Ray worker on every policy.train(), so it holds configuration only.
"""

from __future__ import annotations

from typing import Any

import torch
from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn

from bapo_nemo.algorithm import search_clip_bounds
from bapo_nemo.algorithm.bapo import importance_ratio
from bapo_nemo.algorithm.options import NemoBAPOOptions
from bapo_nemo.nemo.groups import data_parallel_all_reduce, full_tensor
from bapo_nemo.nemo.loss_math import (
    PREFIX,
    bounds_to_epsilons,
    data_for_parent,
    importance_weights_like_nemo,
    nemo_step_metrics,
    token_sign_counts,
)
from bapo_nemo.nemo.step_bounds import STEP_BOUNDS_KEYS


def loss_config(cfg: Any) -> ClippedPGLossConfig:
    return cfg if isinstance(cfg, ClippedPGLossConfig) else ClippedPGLossConfig(**dict(cfg))


def bapo_options_from_loss_config(cfg: ClippedPGLossConfig) -> NemoBAPOOptions:
    """Validate `loss_fn.bapo` against the rest of `loss_fn` (errors name the keys and the fix)."""
    extra = cfg.model_extra or {}
    # No block is plain GRPO, as `check` and the driver's start-up line say, not BAPO at its defaults.
    block = extra.get("bapo", {"enabled": False})
    options = NemoBAPOOptions.parse(block, where="loss_fn.bapo")
    if not options.bapo.enabled:
        return options
    problems = []
    if cfg.disable_ppo_ratio or cfg.force_on_policy_ratio:
        key = "disable_ppo_ratio" if cfg.disable_ppo_ratio else "force_on_policy_ratio"
        problems.append(f"loss_fn.{key}=true removes the importance ratio BAPO clips: set it to false")
    if cfg.use_cispo:
        problems.append(
            "loss_fn.use_cispo=true: CISPO's clipped weights are not BAPO's surrogate; set it to false"
        )
    if cfg.sequence_level_importance_ratios or not cfg.token_level_loss:
        problems.append(
            "BAPO is a token-level objective: set loss_fn.sequence_level_importance_ratios=false and "
            "loss_fn.token_level_loss=true"
        )
    dual = options.bapo.dual_clip
    if dual is not None and cfg.ratio_clip_c is not None and abs(dual - cfg.ratio_clip_c) > 1e-12:
        problems.append(
            f"loss_fn.bapo.dual_clip={dual} and loss_fn.ratio_clip_c={cfg.ratio_clip_c} disagree: set one of them"
        )
    if problems:
        raise ValueError("invalid loss_fn for BAPO:\n  " + "\n  ".join(problems))
    if dual is None and cfg.ratio_clip_c is not None:
        # One dual clip for both the search and the loss: take the parent's.
        flat = options.flat()
        flat["dual_clip"] = cfg.ratio_clip_c
        options = NemoBAPOOptions.parse(flat, where="loss_fn.bapo (dual_clip from loss_fn.ratio_clip_c)")
    return options


class BAPOLossFn(ClippedPGLossFn):
    """ClippedPGLossFn whose clip bounds BAPO chooses per call (or per optimizer step)."""

    def __init__(
        self,
        cfg: ClippedPGLossConfig | dict,
        dtensor_tp: int = 1,
        dtensor_cp: int = 1,
        options: NemoBAPOOptions | None = None,
        **parent_kwargs: Any,
    ):
        """`options`: `bapo_options_from_loss_config(cfg)` where the caller parsed it already. `parent_kwargs`: what the installed ClippedPGLossFn takes besides its config, as setup() gave it
        (`installed.loss_fn_kwargs`; main's `use_fused_linear_logprobs`)."""
        cfg = loss_config(cfg)
        super().__init__(cfg, **parent_kwargs)
        self.options = options if options is not None else bapo_options_from_loss_config(cfg)
        if self.options.bapo.enabled and self.options.bapo.dual_clip is not None:
            self.ratio_clip_c = self.options.bapo.dual_clip
        # DTensor layout, to rebuild the data-parallel group (Megatron workers ignore it).
        self.dtensor_tp, self.dtensor_cp = int(dtensor_tp), int(dtensor_cp)
        # Parent's configured epsilons: used when BAPO is disabled.
        self._configured_epsilons = (self.ratio_clip_min, self.ratio_clip_max)

    def __call__(
        self,
        next_token_logprobs: torch.Tensor,
        data,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict]:
        if not self.options.bapo.enabled:
            return super().__call__(next_token_logprobs, data, global_valid_seqs, global_valid_toks)

        reference = self.options.ratio_reference
        curr = full_tensor(next_token_logprobs)
        token_mask = full_tensor(data["token_mask"])[:, 1:]
        sample_mask = full_tensor(data["sample_mask"])
        mask = token_mask * sample_mask.unsqueeze(-1)
        advantages = full_tensor(data["advantages"])[:, 1:]
        prev = full_tensor(data["prev_logprobs"])[:, 1:]
        gen = full_tensor(data["generation_logprobs"])[:, 1:]
        ref = prev if reference == "proximal" else gen
        ratio = importance_ratio(curr.detach(), ref)

        weights = None
        if self.use_importance_sampling_correction and reference == "proximal":
            weights = importance_weights_like_nemo(
                prev,
                gen,
                token_mask,
                self.truncated_importance_sampling_type,
                self.truncated_importance_sampling_ratio,
                self.truncated_importance_sampling_ratio_min,
            )
        result = self._bounds(data, ratio, advantages, mask, weights)

        # Set per call, restored after: the object stays configuration-only between calls.
        self.ratio_clip_min, self.ratio_clip_max = bounds_to_epsilons(result.c_low, result.c_high)
        try:
            loss, metrics = super().__call__(
                next_token_logprobs, data_for_parent(data, reference), global_valid_seqs, global_valid_toks
            )
        finally:
            self.ratio_clip_min, self.ratio_clip_max = self._configured_epsilons

        with torch.no_grad():
            counts = token_sign_counts(
                ratio, advantages, mask, result.c_low, result.c_high, self.ratio_clip_c
            )
            metrics.update(nemo_step_metrics(result, counts, float(global_valid_toks)))
            if reference == "behavior":
                # The proximal-vs-behaviour gap the parent's mismatch metrics no longer see (k3, token mean).
                log_gap = torch.clamp(prev - gen, -20.0, 20.0)
                k3 = torch.exp(-log_gap) - 1 + log_gap
                metrics[PREFIX + "behavior_kl"] = float((k3 * mask).sum() / float(global_valid_toks))
        return loss, metrics

    def _bounds(self, data, ratio, advantages, mask, weights):
        if self.options.bapo.granularity != "step":
            return search_clip_bounds(
                ratio,
                advantages,
                mask,
                self.options.bapo,
                all_reduce=data_parallel_all_reduce(self.dtensor_tp, self.dtensor_cp),
                weights=weights,
            )
        # Bounds chosen on the driver for the whole optimizer step (StepBoundsTrainer).
        if not all(k in data for k in STEP_BOUNDS_KEYS):
            raise ValueError(
                "loss_fn.bapo.granularity=step: this batch carries no step bounds. They are attached by "
                "bapo_nemo.nemo.step_bounds.StepBoundsTrainer around policy.train (python -m "
                "bapo_nemo.train installs it); or set loss_fn.bapo.granularity=microbatch"
            )
        from bapo_nemo.nemo.step_bounds import bounds_from_data

        return bounds_from_data(data)
