"""Settings of partial rollouts (Kimi k1.5 section 2.6.2): how many tokens a response may grow per
iteration, how often it may be resumed, and how segments written by older policies enter the loss; and the
rules a NeMo-RL v0.7.0 master config must meet to run them (`check_partial_rollout_config`, plain data
only, so `bapo-nemo check` applies them without importing the NeMo-RL adapter)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bapo_nemo.config_errors import validation_lines

StaleSegments = Literal["keep", "exclude", "downweight"]


class PartialRolloutConfigError(ValueError):
    """A partial-rollout setting is invalid; the message names the key and what it accepts."""


class PartialRolloutConfig(BaseModel):
    """Partial-rollout settings. A response grows by at most `token_budget` tokens per iteration; an
    unfinished one is carried over and continued next iteration by the then-current policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_budget: int = Field(
        ..., description="Most new tokens one response may get in one iteration (the segment length)."
    )
    max_resumptions: int = Field(
        8,
        description="How many times an unfinished response may be continued after its first segment; a "
        "response still unfinished after max_resumptions + 1 segments is finished as truncated.",
    )
    max_response_tokens: int | None = Field(
        None,
        description="Cap on a response's total length; reaching it finishes the response as truncated. "
        "None: only max_resumptions bounds the length (at most token_budget * (max_resumptions + 1)).",
    )
    global_token_budget: int | None = Field(
        None,
        description="Most new tokens generated per iteration over all responses. Enforced by scheduling "
        "at most global_token_budget // token_budget responses per iteration, carried-over ones first.",
    )
    max_in_flight_groups: int | None = Field(
        None,
        description="Most prompt groups started but not yet handed out; new prompts are admitted only "
        "to fill free slots. None: every queued prompt starts at once.",
    )
    prompts_per_iteration: int | None = Field(
        None, description="Most new prompts admitted per iteration (None: no per-iteration limit)."
    )
    stale_segments: StaleSegments = Field(
        "keep",
        description="How tokens written by older policy versions enter the loss: keep (weight 1), "
        "exclude (weight 0), downweight (weight stale_weight_decay ** staleness).",
    )
    stale_weight_decay: float = Field(
        0.5, description="downweight only: per-version factor in (0, 1]; staleness s gives decay ** s."
    )

    @field_validator("token_budget")
    @classmethod
    def _budget_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"token_budget must be >= 1 new token per iteration, got {v}")
        return v

    @field_validator("max_resumptions")
    @classmethod
    def _resumptions_non_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"max_resumptions must be >= 0 (0 = never continue a response), got {v}")
        return v

    @field_validator(
        "max_response_tokens", "global_token_budget", "max_in_flight_groups", "prompts_per_iteration"
    )
    @classmethod
    def _optional_positive(cls, v: int | None, info) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"{info.field_name} must be >= 1 or null (no limit), got {v}")
        return v

    @field_validator("stale_weight_decay")
    @classmethod
    def _decay_in_unit_interval(cls, v: float) -> float:
        if not (0.0 < v <= 1.0) or not math.isfinite(v):
            raise ValueError(f"stale_weight_decay must be in (0, 1] (1 = keep), got {v}")
        return v

    @model_validator(mode="after")
    def _global_budget_fits_one_response(self) -> PartialRolloutConfig:
        if self.global_token_budget is not None and self.global_token_budget < self.token_budget:
            raise ValueError(
                f"global_token_budget ({self.global_token_budget}) must be >= token_budget "
                f"({self.token_budget}): otherwise no response could be scheduled in an iteration"
            )
        return self

    @property
    def max_segments(self) -> int:
        return self.max_resumptions + 1

    def stale_weight(self, staleness: int) -> float:
        """Loss weight of a token written `staleness` policy versions ago (0 = current policy)."""
        if staleness <= 0 or self.stale_segments == "keep":
            return 1.0
        if self.stale_segments == "exclude":
            return 0.0
        return self.stale_weight_decay**staleness

    @classmethod
    def parse(cls, data: dict | None, where: str = "partial_rollouts") -> PartialRolloutConfig:
        """Validate a user dict (e.g. a `partial_rollouts:` YAML block) with errors that name the key."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            lines = validation_lines(
                exc, where,
                unknown_key=lambda _: f"unknown key; allowed keys: {', '.join(sorted(cls.model_fields))}",
                missing="required (e.g. token_budget: 2048)",
            )
            raise PartialRolloutConfigError(
                "invalid partial-rollout config:\n  " + "\n  ".join(lines)
            ) from None


# ---- rules on the rest of a NeMo-RL master config ---------------------------------------------------
# MasterConfig is a pydantic model with dict-typed sections; callers may pass it or plain dicts.
def config_get(obj: Any, key: str, default: Any = None) -> Any:
    """`obj[key]` for a dict section, `obj.key` for MasterConfig, `default` when absent or None."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    value = getattr(obj, key, default)
    return default if value is None and default is not None else value


def uses_async_rollouts(generation_cfg: Mapping) -> bool:
    """Mirror of v0.7.0 `grpo._should_use_async_rollouts` (which of the three rollout paths runs)."""
    backend = generation_cfg.get("backend", "")
    if backend == "sglang":
        return bool(generation_cfg.get("use_async_rollouts", False))
    if backend == "vllm":
        return bool((generation_cfg.get("vllm_cfg") or {}).get("async_engine", False))
    if backend == "megatron":
        return bool((generation_cfg.get("mcore_generation_config") or {}).get("async_engine", False))
    return False


def check_partial_rollout_config(master_config: Any, partial: PartialRolloutConfig) -> list[str]:
    """Why this NeMo-RL config cannot run partial rollouts (empty list: it can)."""
    problems = []
    grpo, policy, loss_fn = (
        config_get(master_config, "grpo", {}),
        config_get(master_config, "policy", {}),
        config_get(master_config, "loss_fn", {}),
    )
    generation = config_get(policy, "generation") or {}
    if config_get(grpo, "max_rollout_turns", 1) != 1:
        problems.append(
            f"grpo.max_rollout_turns={config_get(grpo, 'max_rollout_turns')}: partial rollouts are single-turn; set it to 1"
        )
    if config_get(config_get(grpo, "async_grpo", {}) or {}, "enabled", False):
        problems.append(
            "grpo.async_grpo.enabled=true: the async loop runs rollouts in AsyncTrajectoryCollector (a Ray actor) "
            "that this hook cannot reach; use the sync loop (see docs/partial_rollouts.md)"
        )
    if config_get(config_get(master_config, "env", {}) or {}, "should_use_nemo_gym", False):
        problems.append(
            "env.should_use_nemo_gym=true: NeMo-Gym rollouts manage their own generation; disable it"
        )
    if uses_async_rollouts(generation):
        problems.append(
            "policy.generation uses an async engine (vllm_cfg.async_engine / mcore async_engine / "
            "use_async_rollouts): grpo_train then calls run_async_multi_turn_rollout; set it to false"
        )
    if config_get(config_get(master_config, "data_plane", {}) or {}, "enabled", False):
        problems.append(
            "data_plane.enabled=true selects grpo_train_sync, which this hook does not wrap; disable it"
        )
    if partial.stale_segments == "downweight":
        problems.append(
            "partial_rollouts.stale_segments=downweight needs per-token loss weights, but grpo_train v0.7.0 builds "
            "its train_data from a fixed key list (token_mask comes from a 0/1 token_loss_mask): use exclude or keep"
        )
    if partial.stale_segments == "keep" and not config_get(loss_fn, "use_importance_sampling_correction", False):
        problems.append(
            "partial_rollouts.stale_segments=keep trains on tokens sampled by older policies: set "
            "loss_fn.use_importance_sampling_correction=true (weights them by pi_prev/pi_behaviour) or use "
            "stale_segments=exclude"
        )
    prompts_per_step = config_get(grpo, "num_prompts_per_step", 0)
    if partial.max_in_flight_groups is not None and partial.max_in_flight_groups < prompts_per_step:
        problems.append(
            f"partial_rollouts.max_in_flight_groups={partial.max_in_flight_groups} < grpo.num_prompts_per_step="
            f"{prompts_per_step}: a step could never collect its groups"
        )
    if not generation:
        problems.append("policy.generation is missing: GRPO needs a generation config")
    return problems
