"""Settings of partial rollouts (Kimi k1.5 section 2.6.2): how many tokens a response may grow per
iteration, how often it may be resumed, and how segments written by older policies enter the loss."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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
            lines = []
            for err in exc.errors():
                key = ".".join(str(p) for p in err["loc"]) or "(block)"
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] == "extra_forbidden":
                    msg = f"unknown key; allowed keys: {', '.join(sorted(cls.model_fields))}"
                elif err["type"] == "missing":
                    msg = "required (e.g. token_budget: 2048)"
                elif err["type"] == "literal_error":
                    msg = f"{msg} (got {err['input']!r})"
                lines.append(f"{where}.{key}: {msg}")
            raise PartialRolloutConfigError(
                "invalid partial-rollout config:\n  " + "\n  ".join(lines)
            ) from None
