"""How a NeMo-RL v0.7.0 GRPO config lays out on a cluster of `nodes` x `gpus_per_node`: the training and
generation GPUs, the parallel sizes (data-parallel size included) and the setups the memory and step-time
estimates read; with the findings where the layout cannot work (each names the key and the fix)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from bapo_nemo.plan.rules.config_io import get
from bapo_nemo.plan.rules.findings import Finding, value
from bapo_nemo.plan.rules.memory import GenerationSetup, Parallelism, TrainingSetup
from bapo_nemo.plan.rules.models import ModelShape
from bapo_nemo.plan.rules.parallel_fit import Layout, layout_findings


@dataclass(frozen=True)
class ClusterPlan:
    backend: str  # megatron | dtensor
    train_gpus: int
    generation_gpus: int  # 0 when colocated
    parallel: Parallelism
    training: TrainingSetup
    generation: GenerationSetup


def plan_cluster(config: dict, nodes: int, gpus_per_node: int, model: ModelShape | None = None,
                 changed: Collection[str] = ()) -> tuple[ClusterPlan | None, list[Finding]]:
    """World-size decomposition: train GPUs = TP * PP * CP * DP (Megatron) or TP * CP * DP (DTensor).
    `model` and `changed` (the keys the user overrode) let a layout error name what to change and to what."""
    f: list[Finding] = []
    megatron = bool(value(config, "policy.megatron_cfg.enabled"))
    # v0.7.0's base config enables DTensor; Megatron configs switch it off explicitly.
    dtensor = bool(get(config, "policy.dtensor_cfg.enabled", not megatron))
    if megatron and dtensor:
        f.append(
            Finding(
                "error",
                "policy.dtensor_cfg.enabled",
                "both Megatron and DTensor are enabled: set policy.dtensor_cfg.enabled=false for Megatron",
            )
        )
    prefix, tp, pp, cp, sp = _parallel_sizes(config, megatron)
    f += _shape_rules(config, nodes, gpus_per_node)
    world = nodes * gpus_per_node
    colocated, gen_gpus, gen_findings = _generation_gpus(config, nodes, gpus_per_node)
    f += gen_findings
    train_gpus = world - gen_gpus
    model_parallel = tp * pp * cp
    if train_gpus <= 0:
        f.append(
            Finding(
                "error",
                "policy.generation.colocated.resources",
                f"generation takes {gen_gpus} of {world} GPUs: nothing is left for training",
            )
        )
        return None, f
    if train_gpus % model_parallel:
        divisible = int(value(config, "policy.make_sequence_length_divisible_by") or 1)
        layout = Layout(megatron, tp, pp, cp, sp, divisible)
        f += layout_findings(layout, train_gpus, model, set(changed), nodes, gpus_per_node, gen_gpus)
        return None, f
    dp = train_gpus // model_parallel
    if sp and tp == 1:
        f.append(
            Finding(
                "warning",
                f"{prefix}.sequence_parallel",
                "sequence_parallel with TP=1 does nothing: set it false",
            )
        )
    training = _training_setup(config, megatron, prefix, Parallelism(tp, pp, cp, dp, sp))
    generation = GenerationSetup(
        colocated, float(value(config, "policy.generation.vllm_cfg.gpu_memory_utilization"))
    )
    plan = ClusterPlan(
        "megatron" if megatron else "dtensor",
        train_gpus,
        gen_gpus,
        Parallelism(tp, pp, cp, dp, sp),
        training,
        generation,
    )
    return plan, f


def _parallel_sizes(config: dict, megatron: bool) -> tuple[str, int, int, int, bool]:
    """The backend's key prefix and its TP, PP, CP and sequence parallel."""
    prefix = "policy.megatron_cfg" if megatron else "policy.dtensor_cfg"
    tp = int(
        value(
            config, f"{prefix}.tensor_model_parallel_size" if megatron else f"{prefix}.tensor_parallel_size"
        )
    )
    pp = int(value(config, f"{prefix}.pipeline_model_parallel_size")) if megatron else 1
    cp = int(value(config, f"{prefix}.context_parallel_size"))
    sp = (
        bool(value(config, f"{prefix}.sequence_parallel"))
        if megatron
        else bool(get(config, f"{prefix}.sequence_parallel", False))
    )
    return prefix, tp, pp, cp, sp


def _shape_rules(config: dict, nodes: int, gpus_per_node: int) -> list[Finding]:
    f: list[Finding] = []
    for key, want in (("cluster.num_nodes", nodes), ("cluster.gpus_per_node", gpus_per_node)):
        have = value(config, key)
        if have != want:
            flag = "--nodes" if key.endswith("num_nodes") else "--gpus-per-node"
            f.append(
                Finding(
                    "error",
                    key,
                    f"{key}={have} but the job has {flag} {want}: set ++{key}={want} "
                    "(NeMo-RL builds its Ray placement groups from the config, not from Slurm)",
                )
            )
    return f


def _generation_gpus(config: dict, nodes: int, gpus_per_node: int) -> tuple[bool, int, list[Finding]]:
    """Colocated or not, the GPUs generation takes from training (0 when colocated), and what is missing."""
    f: list[Finding] = []
    colocated = bool(value(config, "policy.generation.colocated.enabled"))
    gen_gpus = 0
    if not colocated:
        res = get(config, "policy.generation.colocated.resources", {}) or {}
        if nodes == 1:  # generation takes some of the node's GPUs
            key, what, gpus_each = "gpus_per_node", "on one node needs the number of generation GPUs", 1
        else:  # generation takes whole nodes
            key, what, gpus_each = (
                "num_nodes",
                "on several nodes needs the number of generation nodes",
                gpus_per_node,
            )
        count = int(res.get(key) or 0)
        if not count:
            f.append(
                Finding(
                    "error",
                    f"policy.generation.colocated.resources.{key}",
                    f"non-colocated generation {what}",
                )
            )
        gen_gpus = count * gpus_each
    return colocated, gen_gpus, f


def _training_setup(config: dict, megatron: bool, prefix: str, par: Parallelism) -> TrainingSetup:
    tp, cp, dp, sp = par.tp, par.cp, par.dp, par.sequence_parallel
    mbs = int(value(config, "policy.train_micro_batch_size"))
    gbs = int(value(config, "policy.train_global_batch_size"))
    packing = bool(value(config, "policy.sequence_packing.enabled"))
    seq = int(value(config, "policy.max_total_sequence_length"))
    mb_tokens = (
        int(get(config, "policy.sequence_packing.train_mb_tokens", seq * mbs)) if packing else seq * mbs
    )
    if megatron and packing and bool(value(config, "policy.megatron_cfg.fp8_cfg.enabled")):
        # FP8 pads each packed micro-batch to block * 2*CP * TP(SP) tokens (v0.7.0 megatron/data.py).
        block = {"blockwise": 128, "mxfp8": 32}.get(
            value(config, "policy.megatron_cfg.fp8_cfg.fp8_recipe"), 16
        )
        pad = block * (2 * cp if cp > 1 else 1) * (tp if (tp > 1 and sp) else 1)
        mb_tokens = -(-mb_tokens // pad) * pad
    per_rank_samples = gbs // dp if dp else gbs
    micro_batches = max(1, per_rank_samples // max(1, mbs))
    return TrainingSetup(
        micro_batch_tokens=mb_tokens,
        micro_batches_per_step=micro_batches,
        activation_checkpointing=bool(value(config, f"{prefix}.activation_checkpointing"))
        if megatron
        else bool(get(config, f"{prefix}.activation_checkpointing", False)),
        fp8=megatron and bool(value(config, "policy.megatron_cfg.fp8_cfg.enabled")),
        fp8_param=megatron and bool(value(config, "policy.megatron_cfg.fp8_cfg.fp8_param")),
        grad_reduce_in_fp32=bool(
            value(config, "policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32")
        ),
        distributed_optimizer=bool(value(config, "policy.megatron_cfg.optimizer.use_distributed_optimizer"))
        if megatron
        else True,
        optimizer_cpu_offload=bool(value(config, "policy.megatron_cfg.optimizer.optimizer_cpu_offload"))
        if megatron
        else False,
    )
