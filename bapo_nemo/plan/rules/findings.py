"""What every check of a NeMo-RL v0.7.0 config shares: a finding (its level, the key it names, the
message with the fix), and reading a key with v0.7.0's default where the config leaves it out (a config
may be partial, e.g. a recipe's overrides)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from bapo_nemo.plan.rules.config_io import get

Level = Literal["error", "warning"]

# v0.7.0 defaults (examples/configs/grpo_math_1B.yaml) of the keys the checks read.
NEMO_DEFAULTS: dict[str, Any] = {
    "policy.megatron_cfg.enabled": False,
    "policy.dtensor_cfg.enabled": True,
    "policy.megatron_cfg.tensor_model_parallel_size": 1,
    "policy.megatron_cfg.pipeline_model_parallel_size": 1,
    "policy.megatron_cfg.context_parallel_size": 1,
    "policy.megatron_cfg.sequence_parallel": False,
    "policy.megatron_cfg.activation_checkpointing": False,
    "policy.megatron_cfg.fp8_cfg.enabled": False,
    "policy.megatron_cfg.fp8_cfg.fp8_recipe": "blockwise",
    "policy.megatron_cfg.fp8_cfg.fp8_param": False,
    "policy.megatron_cfg.optimizer.use_distributed_optimizer": True,
    "policy.megatron_cfg.optimizer.optimizer_cpu_offload": False,
    "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32": False,
    "policy.dtensor_cfg.tensor_parallel_size": 1,
    "policy.dtensor_cfg.context_parallel_size": 1,
    "policy.sequence_packing.enabled": True,
    "policy.sequence_packing.fuse_loss": False,
    "policy.dynamic_batching.enabled": False,
    "policy.train_global_batch_size": 512,
    "policy.train_micro_batch_size": 4,
    "policy.max_total_sequence_length": 512,
    "policy.generation.colocated.enabled": True,
    "policy.generation.vllm_cfg.gpu_memory_utilization": 0.6,
    "policy.generation.vllm_cfg.tensor_parallel_size": 1,
    "policy.generation.vllm_cfg.pipeline_parallel_size": 1,
    "policy.generation.vllm_cfg.precision": "bfloat16",
    "policy.generation.vllm_cfg.async_engine": False,
    "grpo.num_prompts_per_step": 32,
    "grpo.num_generations_per_prompt": 16,
    "grpo.async_grpo.enabled": False,
    "loss_fn.use_importance_sampling_correction": False,
    "loss_fn.force_on_policy_ratio": False,
    "cluster.gpus_per_node": 1,
    "cluster.num_nodes": 1,
    "checkpointing.enabled": True,
    "checkpointing.model_save_format": "safetensors",
}


@dataclass(frozen=True)
class Finding:
    level: Level
    key: str
    message: str


def value(config: dict, key: str) -> Any:
    return get(config, key, NEMO_DEFAULTS.get(key))
