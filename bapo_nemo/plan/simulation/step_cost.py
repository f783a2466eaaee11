"""What `loss_fn.bapo.granularity: step` costs in compute, from the planner's model shape and plan.

`step` needs the current log-probs of a whole optimizer step's mini-batch before its first backward.
For the first optimizer step of a rollout batch they are free (NeMo-RL computes `prev_logprobs` at the
current weights just before `policy.train`); every later step costs one extra no-grad forward over its
mini-batch (bapo_nemo/nemo/step_bounds.py). We count matmul FLOPs per sequence of s tokens:

  forward(s) = 2 * N_layers * s  +  2 * V * h * s  +  2 * L * q * s^2
               (weights)           (output layer)    (causal attention: QK^T and AV over s^2 / 2 pairs)

with N_layers the transformer-layer parameters (plan/rules/models.py). A training micro-batch costs a forward,
a backward (2 forwards) and, under full activation recompute, one more forward. Per rollout batch of R
responses trained in k optimizer steps, NeMo-RL v0.7.0 (KL 0: no reference pass) runs:

  generation           ~ 1 forward over R  (counted at its FLOPs; decode runs at far lower utilisation)
  prev_logprobs        1 forward over R
  training             (3 or 4) forwards over R
  step granularity     + (k - 1) / k forwards over R   (one no-grad pass per later optimizer step)

Every pass covers the same sequences, so the shares do not depend on the length distribution or the model;
the absolute FLOPs do, and are reported for scale. Shares are of FLOPs; generation takes longer per FLOP
than training, so the share of wall-clock time is lower than `share_of_step` (an upper bound).
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
