"""Wall-clock estimate of one NeMo-RL v0.7.0 GRPO step and one checkpoint save, to size the Slurm signal lead
(`#SBATCH --signal=B:USR1@SECONDS`): the lead must cover the longest step plus one save and the exit.

A planning figure at assumed efficiencies (`TRAIN_MFU`, ...), not a measurement: step = generation
(generation.py's simulator) + log-prob passes + training, one after the other; save = checkpoint bytes /
the nodes' write bandwidth. Terms and what is left out: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.gpus import GPUS
from bapo_nemo.plan.rules.models import ModelShape

# Dense tensor-core peaks and HBM bandwidth from NVIDIA's data sheets (plan/rules/gpus.py cites them).
GPU_PEAK_BF16_FLOPS = {name: gpu.bf16_flops for name, gpu in GPUS.items()}
GPU_HBM_BYTES_PER_S = {name: gpu.hbm_bytes_per_s for name, gpu in GPUS.items()}
# Assumed efficiencies. TRAIN_MFU: Megatron dense training of 7B-70B models reaches 0.4-0.5 of the BF16
# peak in pre-training; RL micro-batches are smaller and packed, so 0.35. DECODE_MFU for the rare
# compute-bound decode steps. HBM_EFFICIENCY: vLLM decode reaches 0.6-0.8 of the HBM bandwidth.
TRAIN_MFU = 0.35
DECODE_MFU = 0.35
HBM_EFFICIENCY = 0.7
# FP8 (Transformer Engine) training over BF16: +23% tokens/s, NeMo-RL's published Llama-3.1-8B figure.
FP8_TRAIN_SPEEDUP = 1.23
# Per-node write bandwidth to the shared filesystem (GB/s): a conservative NFS/Lustre client figure.
DEFAULT_FS_WRITE_GBPS_PER_NODE = 1.0
# Lead = step + save + this (exit, teardown, refit/offload the model leaves out).
LEAD_MARGIN_SEC = 120.0


@dataclass(frozen=True)
class StepShape:
    """What the training-side estimate reads from a config and a cluster plan (counts per GRPO step)."""

    samples: int  # prompts x generations per prompt
    tokens_per_sample: float  # prompt + response, mean
    tokens_squared_per_sample: float  # E[s^2] of prompt + response (attention)
    optimizer_steps: int  # samples / train_global_batch_size
    logprob_passes: float  # forward passes over the whole rollout batch besides training
    bapo_passes: float  # of which granularity=step's extra ones
    activation_recompute: bool
    fp8_train: bool
    train_gpus: int
    save_bytes_per_param: float  # 14 with the optimizer, 2 without


@dataclass(frozen=True)
class StepTimeEstimate:
    generation_s: float
    logprob_s: float
    train_s: float
    validation_s: float
    save_s: float
    margin_s: float
    bapo_s: float = 0.0  # the part of logprob_s that granularity=step adds

    @property
    def bapo_share(self) -> float:
        """BAPO's own cost (granularity=step's extra passes) as a share of the step."""
        return self.bapo_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def step_s(self) -> float:
        return self.generation_s + self.logprob_s + self.train_s

    @property
    def recommended_lead_s(self) -> int:
        """The longest step (one with validation), one save, the margin; rounded up to a minute."""
        return int(math.ceil((self.step_s + self.validation_s + self.save_s + self.margin_s) / 60.0) * 60)


def step_bounds_passes(config: dict, optimizer_steps: int) -> float:
    """granularity=step's extra no-grad passes, as a share of one pass over the rollout batch."""
    bapo = get(config, "loss_fn.bapo") or {}
    if not (bool(bapo.get("enabled")) and bapo.get("granularity") == "step") or optimizer_steps <= 1:
        return 0.0
    return (optimizer_steps - 1) / optimizer_steps * float(bapo.get("step_bounds_sample", 1.0))


def logprob_passes(config: dict, samples: int, optimizer_steps: int) -> float:
    """Forward-only passes over the rollout batch per GRPO step, as v0.7.0's grpo_train makes them."""
    prev = not (
        bool(get(config, "loss_fn.force_on_policy_ratio", False))
        and get(config, "grpo.seq_logprob_error_threshold") is None
    )
    reference = float(get(config, "loss_fn.reference_policy_kl_penalty", 0.01)) > 0 and not bool(
        get(config, "grpo.skip_reference_policy_logprobs_calculation", False)
    )
    return int(prev) + int(reference) + step_bounds_passes(config, optimizer_steps)


def shape_from_config(
    config: dict, train_gpus: int, tokens_per_sample: float, tokens_squared_per_sample: float | None = None
) -> StepShape:
    """`tokens_per_sample`: the mean prompt + response (plan/simulation/generation.py's length model gives it);
    E[s^2] defaults to its square (every sample of the mean length)."""
    samples = int(get(config, "grpo.num_prompts_per_step", 32)) * int(
        get(config, "grpo.num_generations_per_prompt", 16)
    )
    gbs = int(get(config, "policy.train_global_batch_size", 512))
    optimizer_steps = max(1, samples // gbs)
    megatron = bool(get(config, "policy.megatron_cfg.enabled", False))
    prefix = "policy.megatron_cfg" if megatron else "policy.dtensor_cfg"
    return StepShape(
        samples=samples,
        tokens_per_sample=tokens_per_sample,
        tokens_squared_per_sample=tokens_per_sample**2
        if tokens_squared_per_sample is None
        else tokens_squared_per_sample,
        optimizer_steps=optimizer_steps,
        logprob_passes=logprob_passes(config, samples, optimizer_steps),
        bapo_passes=step_bounds_passes(config, optimizer_steps),
        activation_recompute=bool(get(config, f"{prefix}.activation_checkpointing", False)),
        fp8_train=megatron and bool(get(config, "policy.megatron_cfg.fp8_cfg.enabled", False)),
        train_gpus=train_gpus,
        save_bytes_per_param=14.0 if bool(get(config, "checkpointing.save_optimizer", True)) else 2.0,
    )


def forward_seconds(model: ModelShape, shape: StepShape, gpu: str) -> float:
    """One forward pass over the rollout batch on the training GPUs: 2N FLOPs per token plus causal
    attention, 2 L q E[s^2] per sequence."""
    n = model.num_parameters()
    flops = shape.samples * (
        2.0 * n * shape.tokens_per_sample + 2.0 * model.num_layers * model.q_dim * shape.tokens_squared_per_sample
    )
    rate = (
        shape.train_gpus
        * GPU_PEAK_BF16_FLOPS[gpu]
        * TRAIN_MFU
        * (FP8_TRAIN_SPEEDUP if shape.fp8_train else 1)
    )
    return flops / rate


@dataclass(frozen=True)
class TrainCost:
    """The training GPUs' time for one rollout batch (log-prob passes + training), as forward_seconds
    counts it per sequence: linear in its tokens (dense layers) and in their square (causal attention).
    Async GRPO's simulation charges each batch its own sequences."""

    per_token: float
    per_token_squared: float

    def seconds(self, sequence_tokens) -> float:
        return sum(self.per_token * s + self.per_token_squared * s * s for s in sequence_tokens)


def train_cost(model: ModelShape, shape: StepShape, gpu: str) -> TrainCost:
    """forward_seconds per token and per squared token, times the log-prob and training passes."""
    rate = shape.train_gpus * GPU_PEAK_BF16_FLOPS[gpu] * TRAIN_MFU * (FP8_TRAIN_SPEEDUP if shape.fp8_train else 1)
    passes = shape.logprob_passes + (4 if shape.activation_recompute else 3)
    return TrainCost(
        passes * 2.0 * model.num_parameters() / rate, passes * 2.0 * model.num_layers * model.q_dim / rate
    )


def estimate_step_time(
    model: ModelShape,
    shape: StepShape,
    gpu: str,
    nodes: int,
    generation_s: float,
    validation_s: float,
    fs_write_gbps_per_node: float = DEFAULT_FS_WRITE_GBPS_PER_NODE,
    margin_s: float = LEAD_MARGIN_SEC,
    extra_save_bytes: float = 0.0,
) -> StepTimeEstimate:
    """`generation_s` / `validation_s`: from plan/simulation/generation.py; `extra_save_bytes`: what the driver
    writes into each checkpoint besides the weights (partial_rollouts.json)."""
    n = model.num_parameters()
    forward = forward_seconds(model, shape, gpu)
    train_passes = 4 if shape.activation_recompute else 3  # forward + backward (2x) [+ recomputed forward]
    return StepTimeEstimate(
        generation_s=generation_s,
        logprob_s=shape.logprob_passes * forward,
        train_s=train_passes * forward,
        validation_s=validation_s,
        save_s=(shape.save_bytes_per_param * n + extra_save_bytes) / (nodes * fs_write_gbps_per_node * 1e9),
        margin_s=margin_s,
        bapo_s=shape.bapo_passes * forward,
    )
