"""The `loss_fn.bapo` block of a NeMo-RL master config: `BAPOConfig`'s settings plus the options that only
make sense inside NeMo-RL (which log-probs the clipped ratio is taken against, `ratio_reference`).

The block is flat in YAML (`rho0`, `granularity` and `ratio_reference` side by side). It lives here, not
in `bapo_nemo.nemo`, so that `bapo-nemo check` validates it without importing the NeMo-RL adapter.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bapo_nemo.algorithm.config import BAPOConfig

RatioReference = Literal["proximal", "behavior"]

# Adapter keys live next to BAPOConfig's keys in the same YAML block.
ADAPTER_KEYS = ("ratio_reference", "step_bounds_sample")


class BAPOBlock(BAPOConfig):
    """The flat `loss_fn.bapo` block as one schema: BAPOConfig's keys and the adapter keys. The embedded
    trainer's config holds it as is, so a block tuned on one machine pastes into a NeMo-RL config."""

    ratio_reference: RatioReference = Field(
        "behavior",
        description=(
            "Log-probs the clipped ratio is taken against. proximal: log-probs recomputed with the current "
            "weights at the start of every rollout batch's training (NeMo-RL's prev_logprobs); the ratio is "
            "1 at the first optimizer step of each rollout batch, so BAPO only acts with several optimizer "
            "steps per rollout batch. behavior: the log-probs of the policy that sampled the tokens (vLLM's "
            "generation_logprobs); the ratio carries all off-policyness (stale weights, FP8 generation), as "
            "in the paper."
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
            "docs/nemo_rl.md, 'Cheaper step-wide bounds', gives the measured distance to the exact search. "
            "The embedded trainer's step-wide search is always exact: it takes 1 only."
        ),
    )

    def algorithm(self) -> BAPOConfig:
        """BAPOConfig's settings alone."""
        return BAPOConfig(**self.model_dump(exclude=set(ADAPTER_KEYS)))


class NemoBAPOOptions(BaseModel):
    """Everything BAPOLossFn reads from `loss_fn.bapo`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ratio_reference: RatioReference = Field("behavior", description="See BAPOBlock.ratio_reference.")
    step_bounds_sample: float = Field(1.0, ge=0.0, le=1.0, description="See BAPOBlock.step_bounds_sample.")
    bapo: BAPOConfig = Field(default_factory=BAPOConfig)

    @classmethod
    def parse(cls, block: dict[str, Any] | None, where: str = "loss_fn.bapo") -> NemoBAPOOptions:
        """Validate the flat YAML block (errors name the full key) and split it into adapter options and
        BAPOConfig."""
        parsed = BAPOBlock.parse(block, where=where)  # raises BAPOConfigError naming `where.key`
        return cls(
            ratio_reference=parsed.ratio_reference,
            step_bounds_sample=parsed.step_bounds_sample,
            bapo=parsed.algorithm(),
        )

    def flat(self) -> dict[str, Any]:
        """The flat YAML form again (for logging and checkpoints)."""
        return {
            "ratio_reference": self.ratio_reference,
            "step_bounds_sample": self.step_bounds_sample,
            **self.bapo.model_dump(),
        }
