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

from pydantic import BaseModel, ConfigDict, Field

from bapo_nemo.algorithm.config import BAPOConfig

RatioReference = Literal["proximal", "behavior"]

# Adapter keys live next to BAPOConfig's keys in the same YAML block.
ADAPTER_KEYS = ("ratio_reference",)


class BAPOBlock(BAPOConfig):
    """The flat `loss_fn.bapo` block as one schema: BAPOConfig's keys and `ratio_reference`. The embedded
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

    def algorithm(self) -> BAPOConfig:
        """BAPOConfig's settings alone."""
        return BAPOConfig(**self.model_dump(exclude=set(ADAPTER_KEYS)))


class NemoBAPOOptions(BaseModel):
    """Everything BAPOLossFn reads from `loss_fn.bapo`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ratio_reference: RatioReference = Field("behavior", description="See BAPOBlock.ratio_reference.")
    bapo: BAPOConfig = Field(default_factory=BAPOConfig)

    @classmethod
    def parse(cls, block: dict[str, Any] | None, where: str = "loss_fn.bapo") -> NemoBAPOOptions:
        """Validate the flat YAML block (errors name the full key) and split it into adapter options and
        BAPOConfig."""
        parsed = BAPOBlock.parse(block, where=where)  # raises BAPOConfigError naming `where.key`
        return cls(ratio_reference=parsed.ratio_reference, bapo=parsed.algorithm())

    def flat(self) -> dict[str, Any]:
        """The flat YAML form again (for logging and checkpoints)."""
        return {"ratio_reference": self.ratio_reference, **self.bapo.model_dump()}
