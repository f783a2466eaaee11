"""BAPO configuration: the bound grids, the target, and the modes that pick between the paper and the
authors' code (see docs/algorithm.md for why each mode exists)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bapo_nemo.config_errors import validation_lines

Order = Literal["paper", "reference"]
Measure = Literal["value", "gradient"]
Granularity = Literal["microbatch", "step"]
NonFinitePolicy = Literal["error", "mask"]

# Grid points are counted as integers; this slack absorbs decimal steps that are not exact in binary
# (0.3 / 0.02 = 14.999999999999998 must count as 15 grid steps, so that c_low can reach 0.9).
_GRID_SLACK = 1e-9


class BAPOConfigError(ValueError):
    """A BAPO setting is invalid; the message names the field and what it accepts."""


class BAPOConfig(BaseModel):
    """Settings of BAPO's adaptive clipping (Xi et al., arXiv 2510.18927, Algorithm 1).

    The bounds are absolute importance-ratio bounds (baseline GRPO is [0.8, 1.2]), not epsilons.
    Defaults are the paper's: c_low in [0.6, 0.9] step 0.02, c_high in [1.2, 3.0] step 0.05, rho0 = 0.4.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="False: fixed bounds [c_low_min, c_high_min], no search.")
    rho0: float = Field(0.4, description="Target positive share P / (P + N) (Eq. 8), in (0, 1).")
    c_low_min: float = Field(0.6, description="a-: start of the lower ratio bound.")
    c_low_max: float = Field(0.9, description="b-: largest lower ratio bound.")
    c_low_step: float = Field(0.02, description="delta2: step of the lower bound.")
    c_high_min: float = Field(1.2, description="a+: start of the upper ratio bound.")
    c_high_max: float = Field(3.0, description="b+: largest upper ratio bound.")
    c_high_step: float = Field(0.05, description="delta1: step of the upper bound.")
    order: Order = Field(
        "paper",
        description="paper: raise c_high first, then c_low (Algorithm 1). reference: the authors' "
        "verl code (c_low first, each step clamped to its max, P/N compared with rho0/(1-rho0)).",
    )
    measure: Measure = Field(
        "gradient",
        description="value: Eq. 8 on clipped-surrogate values. gradient: share of |r*A| among tokens "
        "that still carry gradient (not clipped). See docs/algorithm.md for the choice.",
    )
    dual_clip: float | None = Field(
        None, description="Dual-clip constant c > 1 for A < 0 tokens (the authors' code uses 3.0)."
    )
    granularity: Granularity = Field(
        "microbatch",
        description="microbatch: bounds searched per loss call (the authors' code). step: one search per "
        "optimizer step over the whole mini-batch (the paper's 'for each update').",
    )
    pn_eps: float = Field(1e-8, description="reference order only: P / (N + pn_eps), as in the authors' code.")
    nonfinite: NonFinitePolicy = Field(
        "error", description="error: raise on NaN/inf in log-probs or advantages. mask: drop and count them."
    )

    # ---- validation: every message names the field and what it accepts -------------------------
    @field_validator("rho0")
    @classmethod
    def _rho0_in_open_unit_interval(cls, v: float) -> float:
        if not (0.0 < v < 1.0) or not math.isfinite(v):
            raise ValueError(f"rho0 must be a positive share strictly between 0 and 1 (paper: 0.4), got {v}")
        return v

    @field_validator("c_low_step", "c_high_step", "pn_eps")
    @classmethod
    def _positive(cls, v: float, info) -> float:
        if not (v > 0) or not math.isfinite(v):
            raise ValueError(f"{info.field_name} must be > 0, got {v}")
        return v

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip_above_one(cls, v: float | None) -> float | None:
        if v is not None and not v > 1.0:
            raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or null to disable, got {v}")
        return v

    @model_validator(mode="after")
    def _ranges_not_empty(self) -> BAPOConfig:
        if not (0.0 < self.c_low_min <= self.c_low_max < 1.0):
            raise ValueError(
                f"c_low range [c_low_min={self.c_low_min}, c_low_max={self.c_low_max}] must satisfy "
                "0 < c_low_min <= c_low_max < 1 (paper: [0.6, 0.9])"
            )
        if not (1.0 < self.c_high_min <= self.c_high_max):
            raise ValueError(
                f"c_high range [c_high_min={self.c_high_min}, c_high_max={self.c_high_max}] must satisfy "
                "1 < c_high_min <= c_high_max (paper: [1.2, 3.0])"
            )
        if self.dual_clip is not None and self.dual_clip <= self.c_high_max:
            # Dual clip caps the ratio of negative tokens; below c_high it would override the upper clip.
            raise ValueError(f"dual_clip={self.dual_clip} must exceed c_high_max={self.c_high_max}")
        return self

    # ---- the integer grids ------------------------------------------------------------------------
    def c_low_grid(self) -> list[float]:
        return _grid(self.c_low_min, self.c_low_max, self.c_low_step, clamp_last=self.order == "reference")

    def c_high_grid(self) -> list[float]:
        return _grid(self.c_high_min, self.c_high_max, self.c_high_step, clamp_last=self.order == "reference")

    @property
    def pn_target(self) -> float:
        """The P/N target equivalent to the share target: rho >= rho0  <=>  P/N >= rho0 / (1 - rho0)."""
        return self.rho0 / (1.0 - self.rho0)

    @classmethod
    def from_reference_recipe(
        cls,
        adv_ratio_target: float = 1.0,
        ratio_lower_start: float = 0.6,
        ratio_lower_max: float = 0.8,
        ratio_lower_step: float = 0.05,
        ratio_upper_start: float = 1.2,
        ratio_upper_max: float = 2.0,
        ratio_upper_step: float = 0.05,
        eps: float = 1e-8,
        clip_ratio_c: float | None = 3.0,
        **overrides,
    ) -> BAPOConfig:
        """Build the config that reproduces the authors' verl recipe (`recipe/bapo/policy_loss.py`); the
        arguments are that recipe's names and YAML defaults. Its P/N target q is our share q / (1 + q)."""
        fields = {
            "rho0": adv_ratio_target / (1.0 + adv_ratio_target),
            "c_low_min": ratio_lower_start,
            "c_low_max": ratio_lower_max,
            "c_low_step": ratio_lower_step,
            "c_high_min": ratio_upper_start,
            "c_high_max": ratio_upper_max,
            "c_high_step": ratio_upper_step,
            "pn_eps": eps,
            "dual_clip": clip_ratio_c,
            "order": "reference",
            "measure": "value",
        }
        return cls(**(fields | overrides))

    @classmethod
    def parse(cls, data: dict | None, where: str = "bapo") -> BAPOConfig:
        """Validate a user dict (e.g. the `bapo:` block of a YAML file) with errors that name the key."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            lines = validation_lines(
                exc, where, unknown_key=lambda _: f"unknown key; allowed keys: {', '.join(sorted(cls.model_fields))}"
            )
            raise BAPOConfigError("invalid BAPO config:\n  " + "\n  ".join(lines)) from None


def _grid(start: float, stop: float, step: float, clamp_last: bool) -> list[float]:
    """Grid points start + k*step, k counted as an integer (no float drift).

    paper order: k = 0..floor((stop-start)/step), every point <= stop (Algorithm 1's `+ delta <= b` test).
    reference order: the authors' `min(cur + step, max)` walk, so a last partial step lands on `stop`.
    """
    span = (stop - start) / step
    n_full = math.floor(span + _GRID_SLACK)
    points = [round(start + k * step, 12) for k in range(n_full + 1)]
    if clamp_last and stop - points[-1] > _GRID_SLACK * max(1.0, abs(stop)):
        points.append(stop)
    return points
