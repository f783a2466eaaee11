"""What `loss_fn.bapo.granularity: step` costs in compute, from the planner's model shape and plan.

Every optimizer step of a rollout batch after the first costs one extra no-grad forward over its
mini-batch (bapo_nemo/nemo/step_bounds.py). Counted in matmul FLOPs of passes over the same sequences, so
the shares hold whatever the lengths; `share_of_step` is of FLOPs, an upper bound on the share of wall
time. The FLOP counts: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_nemo.plan.rules.models import ModelShape


@dataclass(frozen=True)
class StepCost:
    optimizer_steps: int  # k per rollout batch
    extra_passes: int  # k - 1 no-grad forwards over one mini-batch each
    forward_pflops: float  # one forward over the rollout batch
    training_pflops: float  # prev_logprobs + training, per rollout batch, without step granularity
    generation_pflops: float
    extra_pflops: float
    share_of_training: float  # extra / (training + extra)
    share_of_step: float  # extra / (generation + training + extra): an upper bound on the time share


def forward_flops(model: ModelShape, seq_tokens: float, seq_tokens_squared: float) -> float:
    """Matmul FLOPs of one forward over a sequence with E[s] = seq_tokens and E[s^2] = seq_tokens_squared."""
    h = model.hidden_size
    layer = h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h + 3 * h * model.intermediate_size
    return (
        2.0 * model.num_layers * layer * seq_tokens
        + 2.0 * model.vocab_size * h * seq_tokens
        + 2.0 * model.num_layers * model.q_dim * seq_tokens_squared
    )


def step_granularity_cost(
    model: ModelShape,
    rollout_responses: int,
    global_batch: int,
    activation_recompute: bool,
    seq_tokens: float,
    seq_tokens_squared: float,
) -> StepCost:
    k = max(1, rollout_responses // global_batch)
    fwd = rollout_responses * forward_flops(model, seq_tokens, seq_tokens_squared)
    training = fwd * (1 + (4 if activation_recompute else 3))
    generation = fwd
    extra = fwd * (k - 1) / k
    return StepCost(
        optimizer_steps=k,
        extra_passes=k - 1,
        forward_pflops=fwd / 1e15,
        training_pflops=training / 1e15,
        generation_pflops=generation / 1e15,
        extra_pflops=extra / 1e15,
        share_of_training=extra / (training + extra),
        share_of_step=extra / (generation + training + extra),
    )
