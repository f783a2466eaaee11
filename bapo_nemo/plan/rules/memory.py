"""Per-GPU memory estimate for NeMo-RL v0.7.0 GRPO on the Megatron backend (bytes; GB = 1e9 bytes): the larger
of the training and the generation peak, erring on the high side (docs/architecture.md).

Notation: P_s = parameters of the heaviest pipeline stage held by one tensor-parallel rank;
t = tokens of one micro-batch (packed: train_mb_tokens); L_s = layers per pipeline stage;
h = hidden size, q = query width (heads * head_dim), kv = key/value width, f = MLP width, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.gpus import GPUS
from bapo_nemo.plan.rules.models import ModelShape

GB = 1e9
# CUDA context, NCCL communicators and workspace per GPU: a flat allowance (measured 2.5-4 GB on H100).
RUNTIME_RESERVE_BYTES = 4 * GB
# Caching-allocator fragmentation on the training peak.
FRAGMENTATION = 0.10
GPU_CAPACITY_GB = {name: gpu.memory_gb for name, gpu in GPUS.items()}


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    cp: int
    dp: int
    sequence_parallel: bool


@dataclass(frozen=True)
class TrainingSetup:
    micro_batch_tokens: int  # tokens per micro-batch on one DP rank before CP split
    micro_batches_per_step: int  # per DP rank per optimizer step
    activation_checkpointing: bool  # Megatron full recompute
    fp8: bool
    fp8_param: bool
    grad_reduce_in_fp32: bool
    distributed_optimizer: bool
    optimizer_cpu_offload: bool


@dataclass(frozen=True)
class GenerationSetup:
    colocated: bool
    gpu_memory_utilization: float


@dataclass
class MemoryEstimate:
    terms: dict[str, float] = field(default_factory=dict)  # training-phase terms, bytes
    training_peak: float = 0.0
    generation_peak: float = 0.0
    generation_terms: dict[str, float] = field(default_factory=dict)
    capacity: float = 0.0

    @property
    def peak(self) -> float:
        return max(self.training_peak, self.generation_peak)

    @property
    def margin(self) -> float:
        return self.capacity - self.peak

    @property
    def fits(self) -> bool:
        return self.margin >= 0


def stage_parameters(model: ModelShape, par: Parallelism) -> float:
    """P_s = (ceil(L / pp) * layer_params + V * h) / tp.

    The heaviest stage: the last one holds ceil(L/pp) layers plus the output layer (V*h), the first
    one the same number of layers plus the embedding (V*h); with pp = 1 the one stage holds both
    (2*V*h untied). Layer and vocabulary weights are split over tp; norms (tiny) are not counted apart.
    """
    h = model.hidden_size
    layer = h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h + 3 * h * model.intermediate_size + 2 * h
    layers = -(-model.num_layers // par.pp)
    vocab_blocks = (1 if model.tie_word_embeddings else 2) if par.pp == 1 else 1
    return (layers * layer + vocab_blocks * model.vocab_size * h) / par.tp


def weight_bytes(p_stage: float, train: TrainingSetup) -> float:
    """bf16 weights: 2 * P_s. With FP8 (Transformer Engine) add the FP8 copies of the GEMM weights TE
    keeps between micro-batches, 2 bytes (cast + transpose) * P_s; with fp8_param the bf16 copy is
    replaced by FP8 (1 byte) and one FP8 transpose remains: 2 * P_s in total."""
    if not train.fp8:
        return 2 * p_stage
    return 2 * p_stage if train.fp8_param else 4 * p_stage


def gradient_bytes(p_stage: float, train: TrainingSetup) -> float:
    """Megatron DDP gradient buffer: 2 * P_s in bf16, 4 * P_s with grad_reduce_in_fp32."""
    return (4 if train.grad_reduce_in_fp32 else 2) * p_stage


def optimizer_bytes(p_stage: float, par: Parallelism, train: TrainingSetup) -> float:
    """Adam: fp32 main weights + first + second moment = 12 * P_s. The distributed optimizer shards
    them over the data-parallel group *with* context parallelism (CP ranks hold the same weights):
    12 * P_s / (dp * cp). Assumes fp32 moments (precision-aware bf16 moments would halve two terms).
    CPU offload of the optimizer: 0 on the GPU."""
    if train.optimizer_cpu_offload:
        return 0.0
    shards = par.dp * par.cp if train.distributed_optimizer else 1
    return 12 * p_stage / shards


def layer_activation_bytes_per_token(model: ModelShape) -> float:
    """Activations one transformer layer saves for backward, per token, bf16 (Korthikanti et al. 2022
    without dropout, with flash attention so no s^2 term, for a GQA + SwiGLU layer):
    2 * (5h + 2q + 2kv + 3f): norm inputs/outputs and residual (h each: ln1-in, qkv-in, ln2-in,
    fc1-in, plus the residual), q and attention output (q each), k and v (kv each), gate, up and
    activation output of the MLP (f each)."""
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.intermediate_size
    return 2.0 * (5 * h + 2 * q + 2 * kv + 3 * f)


def activation_bytes(model: ModelShape, par: Parallelism, train: TrainingSetup) -> float:
    """Activations of the first pipeline stage at its peak.

    Tokens per GPU: t / cp (context parallelism splits the sequence), further / tp for the parts
    sequence parallelism splits (we apply / tp to the whole layer when SP is on; without SP the
    norm/residual parts are replicated, so we do not divide at all: conservative).
    Without recompute: L_s layers * per-layer bytes * tokens, times the micro-batches in flight on the
    first stage under 1F1B, min(pp, micro-batches).
    With full recompute: only each layer's input (2h bytes per token) is kept per layer and micro-batch
    in flight, plus one layer's full activations while it is recomputed.
    """
    tokens = train.micro_batch_tokens / par.cp / (par.tp if par.sequence_parallel else 1)
    layers = -(-model.num_layers // par.pp)
    in_flight = min(par.pp, max(1, train.micro_batches_per_step))
    full_layer = layer_activation_bytes_per_token(model) * tokens
    if not train.activation_checkpointing:
        return layers * full_layer * in_flight
    return layers * 2.0 * model.hidden_size * tokens * in_flight + full_layer


def logits_bytes(model: ModelShape, par: Parallelism, train: TrainingSetup) -> float:
    """Full-vocabulary logits on the last stage: NeMo-RL casts them to fp32 for the log-prob and keeps
    the fp32 logits, the log-softmax output and its gradient: 3 * 4 bytes * (V / tp) * t / cp.
    (The chunked fused linear-CE path that avoids this does not support CP or packing in v0.7.0.)"""
    return 3 * 4.0 * (model.vocab_size / par.tp) * train.micro_batch_tokens / par.cp


def estimate(
    model: ModelShape, par: Parallelism, train: TrainingSetup, gen: GenerationSetup, gpu: str = "h100-80gb"
) -> MemoryEstimate:
    """Training peak = (weights + gradients + optimizer + activations + logits) * (1 + fragmentation)
    + runtime reserve. Generation peak (colocated), at the weight refit: NeMo-RL v0.7.0 moves gradients
    and optimizer states to CPU before refit (`offload_before_refit`) and the training weights only
    after it (`offload_after_refit`), so during refit the bf16 training weights (2 * P_s) sit next to
    vLLM's share gpu_memory_utilization * capacity (weights, KV cache, CUDA graphs); + reserve. This
    sum is an upper bound: vLLM's KV cache is only allocated after refit.
    Non-colocated: vLLM runs on other GPUs; the training GPUs only see the training peak."""
    capacity = GPU_CAPACITY_GB[gpu] * GB
    p_stage = stage_parameters(model, par)
    terms = {
        "weights": weight_bytes(p_stage, train),
        "gradients": gradient_bytes(p_stage, train),
        "optimizer states": optimizer_bytes(p_stage, par, train),
        "activations": activation_bytes(model, par, train),
        "logits (fp32, full vocab)": logits_bytes(model, par, train),
    }
    training_peak = sum(terms.values()) * (1 + FRAGMENTATION) + RUNTIME_RESERVE_BYTES
    generation_terms: dict[str, float] = {}
    generation_peak = 0.0
    if gen.colocated:
        generation_terms = {
            "training weights (during refit)": 2 * p_stage,
            "vLLM (gpu_memory_utilization x capacity)": gen.gpu_memory_utilization * capacity,
        }
        generation_peak = sum(generation_terms.values()) + RUNTIME_RESERVE_BYTES
    return MemoryEstimate(
        terms=terms,
        training_peak=training_peak,
        generation_peak=generation_peak,
        generation_terms=generation_terms,
        capacity=capacity,
    )


def memory_rules(backend: str, mem: MemoryEstimate | None) -> list[Finding]:
    """The estimate's verdict as findings: an error when the peak does not fit the GPU (it needs `--gpu`,
    so only `bapo-nemo check` runs it), and a warning that the DTensor estimate is indicative."""
    if mem is None:
        return []
    f: list[Finding] = []
    if backend != "megatron":
        f.append(
            Finding(
                "warning",
                "policy.megatron_cfg.enabled",
                "the memory model covers the Megatron backend; the DTensor estimate is indicative",
            )
        )
    if not mem.fits:
        f.append(
            Finding(
                "error",
                "policy.megatron_cfg",
                f"estimated peak {mem.peak / GB:.1f} GB exceeds {mem.capacity / GB:.0f} GB per GPU: "
                "raise TP/CP/PP, turn on activation_checkpointing, or lower "
                "gpu_memory_utilization / train_mb_tokens",
            )
        )
    return f
