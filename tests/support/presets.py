"""The shipped NeMo-RL presets and the overrides of them that several tests run."""

NEMO_PRESETS = ["bapo_7b.yaml", "bapo_32b.yaml", "bapo_32b_64k.yaml", "bapo_32b_partial.yaml"]

# bapo_32b as an async run: 4 generation nodes, the training replica TP 8 x CP 4 on the other 4.
ASYNC_32B = [
    "grpo.async_grpo.enabled=true",
    "grpo.async_grpo.in_flight_weight_updates=true",
    "policy.generation.colocated.enabled=false",
    "++policy.generation.colocated.resources={num_nodes: 4, gpus_per_node: 8}",
    "policy.generation.vllm_cfg.async_engine=true",
    "policy.generation.vllm_cfg.gpu_memory_utilization=0.8",
]


QWEN3_32B_RECIPE = """
grpo: {num_prompts_per_step: 64, num_generations_per_prompt: 32}
loss_fn: {force_on_policy_ratio: true, use_importance_sampling_correction: false}
checkpointing: {enabled: false}   # as published (its parent's model_save_format would fail a Megatron save)
policy:
  model_name: Qwen/Qwen3-32B
  train_global_batch_size: 2048
  train_micro_batch_size: 1
  logprob_batch_size: 4
  max_total_sequence_length: 4096
  make_sequence_length_divisible_by: 4   # ${policy.megatron_cfg.tensor_model_parallel_size}
  dtensor_cfg: {enabled: false}
  sequence_packing: {enabled: true, train_mb_tokens: 4096}   # parent: max_total_sequence_length x mbs
  megatron_cfg:
    enabled: true
    tensor_model_parallel_size: 4
    pipeline_model_parallel_size: 4
    context_parallel_size: 1
    sequence_parallel: true
    activation_checkpointing: false
    fp8_cfg: {enabled: false}
    optimizer: {use_distributed_optimizer: true}
  generation:
    colocated: {enabled: true}
    vllm_cfg: {tensor_parallel_size: 4, gpu_memory_utilization: 0.6, precision: bfloat16}
cluster: {gpus_per_node: 8, num_nodes: 4}
"""
