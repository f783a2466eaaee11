"""Rules of a NeMo-RL GRPO config for one cluster shape: what would otherwise fail or silently misbehave hours
into a cluster job; each finding names the key and the fix. Here: keys, the BAPO block, parallel sizes,
batches, generation, the loss and checkpoints (other blocks: `*_checks.py`), all run through
plan/registry.py. A partial config (a recipe's overrides) takes v0.7.0's defaults for missing keys
(`NEMO_DEFAULTS` in findings.py, from `examples/configs/grpo_math_1B.yaml`).
"""

from __future__ import annotations

from bapo_nemo.plan.rules.cluster_plan import ClusterPlan
from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding, value
from bapo_nemo.plan.rules.memory import Parallelism
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.rules.schema import DEFAULT_SCHEMA, unknown_keys


def key_rules(config: dict, nemo_rl: str = DEFAULT_SCHEMA) -> list[Finding]:
    """Every key the NeMo-RL the job runs does not know (`nemo_rl`: schema.SCHEMAS), with the nearest key."""
    return [Finding("error", u.path, u.message()) for u in unknown_keys(config, nemo_rl)]


def bapo_block_rules(config: dict) -> list[Finding]:
    block = get(config, "loss_fn.bapo")
    if block is None:
        return []
    from bapo_nemo.algorithm.config import BAPOConfigError
    from bapo_nemo.algorithm.options import NemoBAPOOptions

    try:
        NemoBAPOOptions.parse(block)
    except BAPOConfigError as exc:
        return [Finding("error", "loss_fn.bapo", line.strip()) for line in str(exc).splitlines()[1:]]
    return []


def bapo_enabled(config: dict) -> bool:
    block = get(config, "loss_fn.bapo")
    return isinstance(block, dict) and block.get("enabled", True)


def parallel_rules(config: dict, plan: ClusterPlan, model: ModelShape | None) -> list[Finding]:
    """Parallel sizes against the model's heads and layers, the sequence padding they need, and
    NeMo-RL's log-prob batch assert at TP >= 4."""
    f: list[Finding] = []
    par = plan.parallel
    prefix = "policy.megatron_cfg" if plan.backend == "megatron" else "policy.dtensor_cfg"
    tp_key = (
        f"{prefix}.tensor_model_parallel_size"
        if plan.backend == "megatron"
        else f"{prefix}.tensor_parallel_size"
    )
    if model is not None:
        f += _model_split_rules(par, model, prefix, tp_key)
    if plan.backend == "megatron":
        f += _megatron_sequence_rules(config, par)
    return f + _logprob_batch_rules(config, par)


def _model_split_rules(par: Parallelism, model: ModelShape, prefix: str, tp_key: str) -> list[Finding]:
    f: list[Finding] = []
    if model.num_attention_heads % par.tp:
        f.append(
            Finding(
                "error",
                tp_key,
                f"TP={par.tp} does not divide the {model.num_attention_heads} attention "
                f"heads of {model.name}: use a divisor of {model.num_attention_heads}",
            )
        )
    if model.num_key_value_heads % par.tp and par.tp % model.num_key_value_heads:
        f.append(
            Finding(
                "error",
                tp_key,
                f"TP={par.tp} and the {model.num_key_value_heads} KV heads of {model.name} "
                "do not divide each other (Megatron needs one to divide the other)",
            )
        )
    if model.num_layers % par.pp:
        f.append(
            Finding(
                "warning",
                f"{prefix}.pipeline_model_parallel_size",
                f"PP={par.pp} does not divide {model.num_layers} layers: set "
                "num_layers_in_first/last_pipeline_stage or the stages are unbalanced",
            )
        )
    return f


def _megatron_sequence_rules(config: dict, par: Parallelism) -> list[Finding]:
    f: list[Finding] = []
    packing = bool(value(config, "policy.sequence_packing.enabled"))
    divisible = int(value(config, "policy.make_sequence_length_divisible_by") or 1)
    factor = (2 * par.cp if par.cp > 1 else 1) * (par.tp if (par.tp > 1 and par.sequence_parallel) else 1)
    if divisible % factor:
        f.append(
            Finding(
                "error",
                "policy.make_sequence_length_divisible_by",
                f"{divisible} is not a multiple of {factor} (2*CP={2 * par.cp if par.cp > 1 else 1}"
                f"{' x TP with sequence parallel' if par.sequence_parallel and par.tp > 1 else ''}): "
                f"set it to {factor} or a multiple",
            )
        )
    if par.cp > 1 and not packing:
        f.append(
            Finding(
                "error",
                "policy.sequence_packing.enabled",
                "context parallelism needs sequence packing in NeMo-RL's Megatron path: set it true",
            )
        )
    if bool(value(config, "policy.megatron_cfg.fp8_cfg.enabled")):
        recipe = value(config, "policy.megatron_cfg.fp8_cfg.fp8_recipe")
        block = {"blockwise": 128, "mxfp8": 32}.get(recipe, 16)
        seq = int(value(config, "policy.max_total_sequence_length"))
        pad = block * factor
        if seq % pad:
            f.append(
                Finding(
                    "warning",
                    "policy.max_total_sequence_length",
                    f"FP8 {recipe} pads packed micro-batches to a multiple of {pad} ({block} x {factor}): "
                    f"{seq} is not one, so the longest micro-batch grows to {-(-seq // pad) * pad} tokens",
                )
            )
    return f


def _logprob_batch_rules(config: dict, par: Parallelism) -> list[Finding]:
    f: list[Finding] = []
    tp_logprob_rule = par.tp >= 4 and "logprob_batch_size" in (config.get("policy") or {})
    if tp_logprob_rule and not bool(value(config, "loss_fn.force_on_policy_ratio")):
        mbs, lbs = value(config, "policy.train_micro_batch_size"), get(config, "policy.logprob_batch_size")
        if mbs != lbs:
            f.append(
                Finding(
                    "error",
                    "policy.logprob_batch_size",
                    f"TP={par.tp} >= 4 needs logprob_batch_size == train_micro_batch_size ({lbs} != {mbs}) "
                    "(NeMo-RL's batch-variant accuracy assert): set both equal",
                )
            )
    return f
    return f


def batch_rules(config: dict, plan: ClusterPlan) -> list[Finding]:
    f: list[Finding] = []
    gbs = int(value(config, "policy.train_global_batch_size"))
    mbs = int(value(config, "policy.train_micro_batch_size"))
    rollout = int(value(config, "grpo.num_prompts_per_step")) * int(
        value(config, "grpo.num_generations_per_prompt")
    )
    dp = plan.parallel.dp
    if gbs % dp:
        f.append(
            Finding(
                "error",
                "policy.train_global_batch_size",
                f"{gbs} is not a multiple of the data-parallel size {dp}: use a multiple of {dp}",
            )
        )
    elif (gbs // dp) % mbs and not bool(value(config, "policy.sequence_packing.enabled")):
        f.append(
            Finding(
                "error",
                "policy.train_micro_batch_size",
                f"{gbs // dp} samples per DP rank are not a multiple of the micro-batch size {mbs}",
            )
        )
    if rollout % gbs:
        f.append(
            Finding(
                "error",
                "policy.train_global_batch_size",
                f"a rollout batch of {rollout} samples (num_prompts_per_step x num_generations_per_prompt) "
                f"is not a multiple of train_global_batch_size={gbs}",
            )
        )
    return f


def generation_rules(config: dict, plan: ClusterPlan | None, model: ModelShape | None) -> list[Finding]:
    f: list[Finding] = []
    precision = value(config, "policy.generation.vllm_cfg.precision")
    is_corr = bool(value(config, "loss_fn.use_importance_sampling_correction"))
    if precision == "fp8" and not is_corr:
        f.append(
            Finding(
                "error",
                "loss_fn.use_importance_sampling_correction",
                "FP8 vLLM generation (policy.generation.vllm_cfg.precision=fp8) samples from a different "
                "policy than the bf16/FP8 trainer: set loss_fn.use_importance_sampling_correction=true",
            )
        )
    vllm_tp = int(value(config, "policy.generation.vllm_cfg.tensor_parallel_size"))
    vllm_pp = int(value(config, "policy.generation.vllm_cfg.pipeline_parallel_size"))
    if model is not None and model.num_attention_heads % vllm_tp:
        f.append(
            Finding(
                "error",
                "policy.generation.vllm_cfg.tensor_parallel_size",
                f"vLLM TP={vllm_tp} does not divide the {model.num_attention_heads} attention heads",
            )
        )
    if plan is not None:
        gen_gpus = plan.generation_gpus or plan.train_gpus
        if gen_gpus % (vllm_tp * vllm_pp):
            f.append(
                Finding(
                    "error",
                    "policy.generation.vllm_cfg.tensor_parallel_size",
                    f"{gen_gpus} generation GPUs are not a multiple of vLLM TP*PP = {vllm_tp * vllm_pp}",
                )
            )
    return f


def loss_rules(config: dict, plan: ClusterPlan | None) -> list[Finding]:
    if not bapo_enabled(config):
        return []
    f: list[Finding] = []
    packing = bool(value(config, "policy.sequence_packing.enabled"))
    backend = (
        plan.backend if plan else ("megatron" if value(config, "policy.megatron_cfg.enabled") else "dtensor")
    )
    if packing and backend == "megatron" and not bool(value(config, "policy.sequence_packing.fuse_loss")):
        f.append(
            Finding(
                "error",
                "policy.sequence_packing.fuse_loss",
                "BAPO's bounds are statistics of the whole micro-batch, but with fuse_loss=false NeMo-RL "
                "calls the loss once per packed sequence (different bounds per sequence, and DP ranks with "
                "different sequence counts deadlock in the reduction): set it true",
            )
        )
    if packing and backend == "dtensor":
        f.append(
            Finding(
                "error",
                "policy.sequence_packing.enabled",
                "the DTensor backend of v0.7.0 always calls the loss once per packed sequence (no fused "
                "packed loss): set sequence_packing.enabled=false (dynamic_batching is fine) or use Megatron",
            )
        )
    dtensor_cp = int(value(config, "policy.dtensor_cfg.context_parallel_size") or 1)
    if backend == "dtensor" and dtensor_cp > 1:
        f.append(
            Finding(
                "error",
                "policy.dtensor_cfg.context_parallel_size",
                f"{dtensor_cp}: BAPO under DTensor context parallelism is not supported (its bound search "
                "gathers the data tensors to full length, but the log-probs may reach the loss sharded "
                "along the sequence as plain tensors, and no test covers it): use 1, or the Megatron "
                "backend for context parallelism",
            )
        )
    return f + _ratio_rules(config)


def _ratio_rules(config: dict) -> list[Finding]:
    """The token ratio BAPO clips must exist, and must be able to move away from 1."""
    f: list[Finding] = []
    for key in (
        "loss_fn.force_on_policy_ratio",
        "loss_fn.disable_ppo_ratio",
        "loss_fn.use_cispo",
        "loss_fn.sequence_level_importance_ratios",
    ):
        if get(config, key, False):
            f.append(Finding("error", key, "removes or replaces the token ratio BAPO clips: set it false"))
    block = get(config, "loss_fn.bapo") or {}
    reference = block.get("ratio_reference", "behavior")
    rollout = int(value(config, "grpo.num_prompts_per_step")) * int(
        value(config, "grpo.num_generations_per_prompt")
    )
    gbs = int(value(config, "policy.train_global_batch_size"))
    if reference == "proximal" and rollout == gbs and not bool(value(config, "grpo.async_grpo.enabled")):
        f.append(
            Finding(
                "warning",
                "loss_fn.bapo.ratio_reference",
                "proximal reference with one optimizer step per rollout batch: the clipped ratio is 1 and "
                "BAPO never clips; use ratio_reference=behavior or several optimizer steps per batch",
            )
        )
    # granularity: step's cost is reported on its own line by `bapo-nemo check` (plan/simulation/step_cost.py), not
    # as a warning: it is the shipped cluster default, chosen for that cost (docs/nemo_rl.md).
    return f


def checkpoint_rules(config: dict) -> list[Finding]:
    """v0.7.0's `Policy.save_checkpoint` refuses `checkpointing.model_save_format` for every policy but
    DTensor v2 (lm_policy.py, lines 1079-1085): with Megatron the job's first checkpoint raises. Megatron
    writes its own torch_dist format; NeMo-RL's Megatron recipes set the key to null."""
    if not bool(value(config, "checkpointing.enabled")):
        return []
    save_format = value(config, "checkpointing.model_save_format")
    dtensor_v2 = bool(value(config, "policy.dtensor_cfg.enabled")) and bool(
        get(config, "policy.dtensor_cfg._v2")
    )
    if save_format is None or dtensor_v2:
        return []
    return [
        Finding(
            "error",
            "checkpointing.model_save_format",
            f"{save_format!r} makes NeMo-RL v0.7.0 fail the first checkpoint of a "
            f"{'Megatron' if bool(value(config, 'policy.megatron_cfg.enabled')) else 'DTensor v1'} policy "
            "(only DTensor v2 takes it): set it to null",
        )
    ]
