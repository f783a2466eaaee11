"""The `loss_fn.bapo` block of a NeMo-RL master config: BAPO's own settings (`BAPOConfig`) plus the
options that only make sense inside NeMo-RL (which log-probs the clipped ratio is taken against).

It lives beside `BAPOConfig` (not in `bapo_nemo.nemo`) so that `bapo-nemo check` can validate the block
without importing the NeMo-RL adapter.

The block is flat in YAML, so users write one list of keys:

    loss_fn:
      bapo:
        rho0: 0.4                 # BAPOConfig
        granularity: microbatch   # BAPOConfig
        ratio_reference: behavior # adapter option (this module)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bapo_nemo.algorithm.config import BAPOConfig, BAPOConfigError
from bapo_nemo.config_errors import validation_lines

RatioReference = Literal["proximal", "behavior"]

# Adapter keys live next to BAPOConfig's keys in the same YAML block.
ADAPTER_KEYS = ("ratio_reference", "step_bounds_sample")


class NemoBAPOOptions(BaseModel):
    """Everything BAPOLossFn reads from `loss_fn.bapo`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ratio_reference: RatioReference = Field(
        "behavior",
        description=(
            "Log-probs the clipped ratio is taken against. proximal: NeMo-RL's prev_logprobs, recomputed "
            "with the current weights at the start of every policy.train(); the ratio is 1 at the first "
            "optimizer step of each rollout batch, so BAPO only acts with several optimizer steps per "
            "rollout batch. behavior: generation_logprobs of the policy that sampled the tokens (vLLM); "
            "the ratio carries all off-policyness (stale weights, FP8 generation), as in the paper."
        ),
    )
    step_bounds_sample: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description=(
            "granularity: step only. Share of each later optimizer step's prompt groups (after the first "
            "of a rollout batch) over which the extra no-grad log-prob pass runs; the bounds searched on "
            "that sample clip the whole step. 1: the whole global batch (exact). 0: no extra pass, the "
            "bounds are searched on prev_logprobs (the weights at the start of the rollout batch). "
            "docs/nemo_rl.md, 'Cheaper step-wide bounds', gives the measured distance to the exact search."
        ),
    )
    bapo: BAPOConfig = Field(default_factory=BAPOConfig)

    @classmethod
    def parse(cls, block: dict[str, Any] | None, where: str = "loss_fn.bapo") -> NemoBAPOOptions:
        """Split the flat YAML block into adapter options and BAPOConfig; errors name the full key."""
        block = dict(block or {})
        adapter = {k: block.pop(k) for k in ADAPTER_KEYS if k in block}
        bapo = BAPOConfig.parse(block, where=where)  # raises BAPOConfigError naming `where.key`
        try:
            return cls(bapo=bapo, **adapter)
        except ValidationError as exc:
            lines = validation_lines(exc, where)
            raise BAPOConfigError("invalid BAPO config:\n  " + "\n  ".join(lines)) from None

    def flat(self) -> dict[str, Any]:
        """The flat YAML form again (for logging and checkpoints)."""
        return {
            "ratio_reference": self.ratio_reference,
            "step_bounds_sample": self.step_bounds_sample,
            **self.bapo.model_dump(),
        }
