"""The GPUs `bapo-nemo check --gpu` knows (A100 80GB, H100, H200, B200), from NVIDIA's data sheets (SXM
parts). Tensor-core peaks are dense: the data sheets print them "with sparsity", twice the dense figure.
Each figure's source: docs/architecture.md, "The planner's models".
"""

from __future__ import annotations

from dataclasses import dataclass

from bapo_nemo.plan.rules.findings import Finding, value


@dataclass(frozen=True)
class GPU:
    memory_gb: float
    bf16_flops: float  # dense tensor-core peak
    fp8_flops: float | None  # dense; None: no FP8 tensor cores
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # each way (half the data sheet's per-GPU total)


GPUS: dict[str, GPU] = {
    "a100-80gb": GPU(80.0, 312e12, None, 2.039e12, 300e9),
    "h100-80gb": GPU(80.0, 989.4e12, 1978.9e12, 3.35e12, 450e9),
    "h200-141gb": GPU(141.0, 989.4e12, 1978.9e12, 4.8e12, 450e9),
    "b200-180gb": GPU(180.0, 2.25e15, 4.5e15, 8.0e12, 900e9),
}


def fp8_rules(config: dict, gpu: str) -> list[Finding]:
    """FP8 training (Transformer Engine) and FP8 generation (vLLM) need FP8 tensor cores (compute
    capability 8.9 and up): on a GPU without them the job fails when the first FP8 kernel is built."""
    if GPUS[gpu].fp8_flops is not None:
        return []
    f: list[Finding] = []
    if bool(value(config, "policy.megatron_cfg.enabled")) and bool(value(config, "policy.megatron_cfg.fp8_cfg.enabled")):
        f.append(Finding("error", "policy.megatron_cfg.fp8_cfg.enabled", (
            f"{gpu} has no FP8 tensor cores (Transformer Engine's FP8 needs compute capability 8.9+: H100, H200, "
            "B200): set it false to train in bf16")))
    if value(config, "policy.generation.vllm_cfg.precision") == "fp8":
        f.append(Finding("error", "policy.generation.vllm_cfg.precision", (
            f"fp8: {gpu} has no FP8 tensor cores for vLLM's FP8 weights and activations: set it to bfloat16")))
    return f
