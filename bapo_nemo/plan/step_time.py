"""Wall-clock estimate of one NeMo-RL v0.7.0 GRPO step and one checkpoint save, to size the Slurm signal
lead (`#SBATCH --signal=B:USR1@SECONDS`): on that signal the driver finishes the current step, saves and
exits, so the lead must cover the longest step plus one save plus the exit.

A planning figure from FLOP and byte counts at assumed efficiencies, not a measurement. By default every
sample is taken at `policy.max_total_sequence_length` (the longest step a config can produce).

Step = generation (vLLM) + log-prob passes + policy training, one after the other (synchronous GRPO;
colocated or not, the phases do not overlap). Per phase:
- training: (3 + 1 with full recompute) forward passes of 2*N + attention FLOPs per token, on the training
  GPUs at `TRAIN_MFU` of the dense BF16 peak, x `FP8_TRAIN_SPEEDUP` with FP8 training;
- log-prob passes: one forward each (prev_logprobs unless force_on_policy_ratio; the reference model's
  when its KL penalty is not 0; with loss_fn.bapo.granularity=step one more over each optimizer step's
  global batch after the first of a rollout batch, (k-1)/k of the rollout batch in all);
- generation: per vLLM engine (tensor x pipeline GPUs), sequences run in waves of as many as its KV cache
  holds at full length; a wave takes as many decode steps as its longest sequence has tokens, each the larger of a memory-bound time
  (the engine's weight bytes plus the live KV cache read once per decode step, at `HBM_EFFICIENCY` of the
  HBM bandwidth) and a compute-bound time (2*N FLOPs per sequence per step at `DECODE_MFU`). Prompt
  tokens are counted as decoded (prefill is cheaper: a small over-estimate).
Not modelled (the lead's margin covers them): weight refit to vLLM, offload/onload, Ray data movement,
the driver's reward grading.
Save = bytes of one Megatron checkpoint (bf16 weights 2*N; with the optimizer also fp32 main weights and
two Adam moments, 12*N) / (nodes x per-node write bandwidth to the shared filesystem).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bapo_nemo.plan.config_io import get
from bapo_nemo.plan.models import ModelShape

# Dense (no sparsity) tensor-core peaks and HBM bandwidth, SXM parts, from NVIDIA's H100 and H200
# datasheets: BF16 989.4 TFLOPS on both; HBM3 3.35 TB/s (H100 80 GB), HBM3e 4.8 TB/s (H200 141 GB).
GPU_PEAK_BF16_FLOPS = {"h100-80gb": 989.4e12, "h200-141gb": 989.4e12}
GPU_HBM_BYTES_PER_S = {"h100-80gb": 3.35e12, "h200-141gb": 4.8e12}
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
    """What the estimate reads from a config and a cluster plan (all counts per GRPO step)."""

    samples: int  # prompts x generations per prompt
    tokens_per_sample: float  # prompt + response, mean
    max_tokens_per_sample: int  # policy.max_total_sequence_length: the longest sequence sets a wave's length
    optimizer_steps: int  # samples / train_global_batch_size
    logprob_passes: float  # forward passes over the whole rollout batch besides training
    activation_recompute: bool
    fp8_train: bool
    train_gpus: int
    generation_gpus: int  # colocated: the same GPUs as training
    engine_gpus: int  # vLLM tensor x pipeline parallel size
    generation_weight_bytes_per_param: float  # 1 with FP8 vLLM, 2 with bf16
    kv_bytes_per_element: float
    gpu_memory_utilization: float
    save_bytes_per_param: float  # 14 with the optimizer, 2 without
    validation_samples: int  # generated at each validation (0: none)


@dataclass(frozen=True)
class StepTimeEstimate:
    generation_s: float
    logprob_s: float
    train_s: float
    validation_s: float
    save_s: float
    margin_s: float

    @property
    def step_s(self) -> float:
        return self.generation_s + self.logprob_s + self.train_s

    @property
    def recommended_lead_s(self) -> int:
        """The longest step (one with validation), one save, the margin; rounded up to a minute."""
        return int(math.ceil((self.step_s + self.validation_s + self.save_s + self.margin_s) / 60.0) * 60)


def logprob_passes(config: dict, samples: int, optimizer_steps: int) -> float:
    """Forward-only passes over the rollout batch per GRPO step, as v0.7.0's grpo_train makes them."""
    prev = not (
        bool(get(config, "loss_fn.force_on_policy_ratio", False))
        and get(config, "grpo.seq_logprob_error_threshold") is None
    )
    reference = float(get(config, "loss_fn.reference_policy_kl_penalty", 0.01)) > 0 and not bool(
        get(config, "grpo.skip_reference_policy_logprobs_calculation", False)
    )
    bapo = get(config, "loss_fn.bapo") or {}
    step_bounds = bool(bapo.get("enabled")) and bapo.get("granularity") == "step"
    extra = (optimizer_steps - 1) / optimizer_steps if step_bounds and optimizer_steps > 1 else 0.0
    return int(prev) + int(reference) + extra


def shape_from_config(config: dict, train_gpus: int, generation_gpus: int, fill: float = 1.0) -> StepShape:
    """`fill`: mean tokens per sample as a share of policy.max_total_sequence_length (1 = the longest step)."""
    samples = int(get(config, "grpo.num_prompts_per_step", 32)) * int(
        get(config, "grpo.num_generations_per_prompt", 16)
    )
    gbs = int(get(config, "policy.train_global_batch_size", 512))
    optimizer_steps = max(1, samples // gbs)
    megatron = bool(get(config, "policy.megatron_cfg.enabled", False))
    prefix = "policy.megatron_cfg" if megatron else "policy.dtensor_cfg"
    vllm = "policy.generation.vllm_cfg"
    val_period = int(get(config, "grpo.val_period", 10) or 0)  # v0.7.0 default 10
    return StepShape(
        samples=samples,
        tokens_per_sample=fill * int(get(config, "policy.max_total_sequence_length", 512)),
        max_tokens_per_sample=int(get(config, "policy.max_total_sequence_length", 512)),
        optimizer_steps=optimizer_steps,
        logprob_passes=logprob_passes(config, samples, optimizer_steps),
        activation_recompute=bool(get(config, f"{prefix}.activation_checkpointing", False)),
        fp8_train=megatron and bool(get(config, "policy.megatron_cfg.fp8_cfg.enabled", False)),
        train_gpus=train_gpus,
        generation_gpus=generation_gpus or train_gpus,
        engine_gpus=int(get(config, f"{vllm}.tensor_parallel_size", 1))
        * int(get(config, f"{vllm}.pipeline_parallel_size", 1)),
        generation_weight_bytes_per_param=1.0
        if get(config, f"{vllm}.precision", "bfloat16") == "fp8"
        else 2.0,
        kv_bytes_per_element=1.0
        if str(get(config, f"{vllm}.kv_cache_dtype", "auto")).startswith("fp8")
        else 2.0,
        gpu_memory_utilization=float(get(config, f"{vllm}.gpu_memory_utilization", 0.6)),
        save_bytes_per_param=14.0 if bool(get(config, "checkpointing.save_optimizer", True)) else 2.0,
        validation_samples=int(get(config, "grpo.max_val_samples", 256) or 0) if val_period > 0 else 0,
    )


def attention_forward_flops_per_token(model: ModelShape, seq_tokens: float) -> float:
    """Causal attention within a sequence of `seq_tokens`: QK^T and AV, 2 * q_dim FLOPs per key each,
    seq/2 keys on average: 2 * q_dim * seq per layer per token."""
    return 2.0 * model.num_layers * model.q_dim * seq_tokens


def generation_seconds(
    model: ModelShape, shape: StepShape, samples: int, gpu: str, capacity_bytes: float
) -> float:
    if samples <= 0:
        return 0.0
    n = model.num_parameters()
    g = shape.engine_gpus
    engines = max(1, shape.generation_gpus // g)
    per_engine = math.ceil(samples / engines)
    weights_per_gpu = n * shape.generation_weight_bytes_per_param / g
    kv_per_token_per_gpu = 2 * model.num_layers * model.kv_dim * shape.kv_bytes_per_element / g
    mean, longest = shape.tokens_per_sample, shape.max_tokens_per_sample
    pool = max(0.0, shape.gpu_memory_utilization * capacity_bytes - weights_per_gpu)
    concurrent = max(1, min(per_engine, int(pool // (kv_per_token_per_gpu * longest))))
    waves = math.ceil(per_engine / concurrent)
    # One wave: `longest` decode steps (its longest sequence); the live KV cache grows linearly, mean/2
    # tokens per sequence on average.
    bytes_read = longest * (weights_per_gpu + concurrent * kv_per_token_per_gpu * mean / 2)
    memory_s = bytes_read / (GPU_HBM_BYTES_PER_S[gpu] * HBM_EFFICIENCY)
    flops = concurrent * mean * (2.0 * n + attention_forward_flops_per_token(model, mean)) / g
    compute_s = flops / (GPU_PEAK_BF16_FLOPS[gpu] * DECODE_MFU)
    return waves * max(memory_s, compute_s)


def estimate_step_time(
    model: ModelShape,
    shape: StepShape,
    gpu: str,
    capacity_bytes: float,
    nodes: int,
    fs_write_gbps_per_node: float = DEFAULT_FS_WRITE_GBPS_PER_NODE,
    margin_s: float = LEAD_MARGIN_SEC,
) -> StepTimeEstimate:
    n = model.num_parameters()
    tokens = shape.samples * shape.tokens_per_sample
    forward_flops = tokens * (2.0 * n + attention_forward_flops_per_token(model, shape.tokens_per_sample))
    train_rate = (
        shape.train_gpus
        * GPU_PEAK_BF16_FLOPS[gpu]
        * TRAIN_MFU
        * (FP8_TRAIN_SPEEDUP if shape.fp8_train else 1)
    )
    train_passes = 4 if shape.activation_recompute else 3  # forward + backward (2x) [+ recomputed forward]
    return StepTimeEstimate(
        generation_s=generation_seconds(model, shape, shape.samples, gpu, capacity_bytes),
        logprob_s=shape.logprob_passes * forward_flops / train_rate,
        train_s=train_passes * forward_flops / train_rate,
        validation_s=generation_seconds(model, shape, shape.validation_samples, gpu, capacity_bytes),
        save_s=shape.save_bytes_per_param * n / (nodes * fs_write_gbps_per_node * 1e9),
        margin_s=margin_s,
    )
