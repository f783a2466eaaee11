"""Test fixtures: NeMo-RL v0.7.0's Megatron policy worker on CPU, with a tiny model in Megatron's layout.

`CPUMegatronPolicyWorker` is the upstream seam `Policy(worker_extension_cls_fqn=...)` takes: a subclass of
`MegatronPolicyWorkerImpl` (megatron_policy_worker.py) whose `__init__` builds on CPU what the real one
builds on GPUs. Every other method the GRPO loop calls is upstream's own: `train` (process_global_batch,
get_microbatch_iterator and the packing with CP's 2*cp chunk layout, megatron_forward_backward ->
forward_backward_no_pipelining, LossPostProcessor -> SequencePackingFusionLossWrapper ->
from_parallel_logits_to_logprobs_packed_sequences, the optimizer step, the metric aggregation),
`get_logprobs`, `prepare_for_training`, `prepare_for_lp_inference`, `offload_before_refit`,
`offload_after_refit`, `save_checkpoint`.

What `__init__` replaces, and why (megatron_policy_worker.py lines 242-450):
- `setup_distributed` (NCCL) -> a gloo process group, then megatron-core's real
  `parallel_state.initialize_model_parallel(TP, PP, CP)`.
- `setup_model_and_optimizer` (Megatron-Bridge: HF import, GPTModel with Transformer Engine layers) ->
  for an HF Qwen2 checkpoint, megatron-core's own GPTModel with its local layer spec (`Qwen2GPTModel`, TP 1
  and CP 1: tests/support/megatron_gpt.py converts the weights as Bridge would); for the tiny LM (the
  rehearsals of TP/CP layouts: context-parallel attention is a Transformer Engine kernel),
  `TinyParallelLM` below, a MegatronModule built from megatron-core's own tensor-parallel layers
  (VocabParallelEmbedding, Column/RowParallelLinear, sequence parallel as configured) that reads its
  positions from the packed-sequence parameters in CP's chunk layout. Either is wrapped in megatron-core's
  real `DistributedDataParallel` and optimised by its real `get_megatron_optimizer` (the distributed
  optimizer when configured) and `OptimizerParamScheduler`, configured from `policy.megatron_cfg` as
  NeMo-RL's `_create_megatron_config` does. Resume loads the checkpoint through the Bridge-format load in
  tests/support/nemo_rl_shim/megatron_cpu.py (megatron-core dist_checkpointing).
- `finalize_megatron_setup` -> the model-config hooks Bridge's `_update_model_config_funcs` sets
  (no_sync / grad_sync / param_sync, `finalize_model_grads`, the loss scaler) and the same
  `should_disable_forward_pre_hook` / DP size; no Megatron tokenizer or AutoBridge (refit converters).
- Refit: `prepare_refit_info` / `stream_weights_via_ipc_zmq` convert through Megatron-Bridge and stream
  CUDA-IPC handles over ZMQ (non-colocated: `init_collective` / `broadcast_weights_for_collective`, an NCCL
  broadcast); here rank 0 gathers the model's one-process weights (HF names for the GPTModel, which the
  real engine loads) and posts them to the generation workers' mailbox (tests/support/refit_mailbox.py).
- `get_free_memory_bytes` reads NVML; here a fixed figure.

Test instrumentation (only when `BAPO_REHEARSAL_RECORD_DIR` is set): every loss call's inputs and
outputs, every optimizer step's pre-step weights and DP x CP-reduced gradients, every get_logprobs call,
and the state at init/save, written per rank under that directory for the tests to read.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.support.nemo_rl_shim import megatron_cpu

# Start-up cost, not behaviour: the imports below leave ~700k long-lived objects. Python's cyclic
# collector would walk them over and over while they pile up (~1.5 CPU-s of each worker's start-up), and
# again in every gc.collect() upstream calls to free GPU memory (offload_before_refit,
# prepare_for_lp_inference, prepare_for_training...: ~0.35 CPU-s each, several per step). So no
# collection during the imports, and afterwards they go to the permanent generation (`gc.freeze`), which
# collections skip; everything the worker creates from then on is collected as usual.
_gc_was_enabled = gc.isenabled()
gc.disable()
megatron_cpu.install()  # before any NeMo-RL Megatron import

import ray
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import StragglerDetector
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl
from nemo_rl.utils.timer import Timer

from tests.support import megatron_gpt, refit_mailbox
from tests.support.nemo_faults import RECORD_DIR_ENV, FaultInTheMiddle, reached
from tests.support.nemo_vllm_standins import (
    FFN,
    HIDDEN,
    TP_SPLIT_DIM,
    WEIGHTS_FILE,
    load_weights,
)

gc.freeze()
if _gc_was_enabled:
    gc.enable()



# ---- the tiny LM in Megatron's layout --------------------------------------------------------------------
def _init_normal(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, std=0.02)


def packed_positions(packed_seq_params, local_tokens: int, table_size: int) -> torch.Tensor:
    """Positions of this CP rank's tokens: every packed sequence (padded length L) is split into 2*cp
    chunks and CP rank r holds chunks r and 2*cp-1-r (NeMo-RL's `_get_tokens_on_this_cp_rank`, the layout
    GPTModel's rotary embedding reads from `cu_seqlens_q_padded`). Padding past the position table (only
    the packing pad of the last sequence reaches it) reads the table's last row."""
    cp = parallel_state.get_context_parallel_world_size()
    r = parallel_state.get_context_parallel_rank()
    cu = packed_seq_params.cu_seqlens_q_padded.tolist()
    parts = []
    for start, end in itertools.pairwise(cu):
        chunk = (end - start) // (2 * cp)
        parts += [torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
    positions = torch.cat(parts)
    if positions.numel() != local_tokens:
        raise ValueError(f"{positions.numel()} positions for {local_tokens} local tokens: not CP's layout")
    return positions.clamp(max=table_size - 1)[None]


class TinyParallelLM(MegatronModule):
    """tests/support/nemo_vllm_standins.py's tiny LM with its weights split as Megatron splits a GPTModel's:
    the embedding and output layer by vocabulary over TP, the MLP column- then row-parallel, the position
    table replicated; activations [s, b, h], sequence-parallel between the layers when configured."""

    def __init__(self, config: TransformerConfig, vocab: int, positions: int):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder  # as GPTModel (read by megatron's schedules)
        self.table_size = positions
        self.embedding = tensor_parallel.VocabParallelEmbedding(vocab, HIDDEN, init_method=_init_normal, config=config)
        self.position_embedding = torch.nn.Embedding(positions, HIDDEN)
        self.fc1 = tensor_parallel.ColumnParallelLinear(
            HIDDEN, FFN, config=config, init_method=_init_normal, bias=False, gather_output=False
        )
        self.fc2 = tensor_parallel.RowParallelLinear(
            FFN, HIDDEN, config=config, init_method=_init_normal, bias=False, input_is_parallel=True,
            skip_bias_add=True,
        )
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            HIDDEN, vocab, config=config, init_method=_init_normal, bias=False, gather_output=False
        )

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages hand activations in here (GPTModel's hook); one stage: nothing to take."""
        if input_tensor not in (None, [None]):
            raise NotImplementedError("pipeline parallelism is not rehearsed")

    def forward(self, input_ids, position_ids=None, attention_mask=None, packed_seq_params=None, **_: Any):
        if packed_seq_params is not None:
            position_ids = packed_positions(packed_seq_params, input_ids.shape[1], self.table_size)
        x = self.embedding(input_ids) + self.position_embedding(position_ids)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.sequence_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        h = torch.tanh(x)
        m, _ = self.fc1(h)
        m, _ = self.fc2(torch.tanh(m))
        logits, _ = self.output_layer(h + m)  # [s, b, vocab / tp]
        return logits.transpose(0, 1).contiguous()  # GPTModel's [b, s, vocab / tp]

    # -- one-process weights <-> this rank's shards -------------------------------------------------------
    @torch.no_grad()
    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        params = dict(self.named_parameters())
        for name, value in full.items():
            dim = TP_SPLIT_DIM[name]
            params[name].copy_(value if dim is None else value.chunk(tp, dim)[rank])

    @torch.no_grad()
    def gather_full(self) -> dict[str, torch.Tensor]:
        group = parallel_state.get_tensor_model_parallel_group()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        out = {}
        for name, p in self.named_parameters():
            dim = TP_SPLIT_DIM[name]
            if dim is None:
                out[name] = p.detach().clone()
                continue
            parts = [torch.empty_like(p) for _ in range(tp)]
            torch.distributed.all_gather(parts, p.detach().contiguous(), group=group)
            out[name] = torch.cat(parts, dim=dim)
        return out


# ---- the worker ----------------------------------------------------------------------------------------
def _transformer_config(policy_cfg: dict, hf_config=None) -> TransformerConfig:
    """The model-config fields NeMo-RL sets from policy.megatron_cfg (setup.py `_apply_parallelism_config`,
    `_validate_training_config`, precision) on the model's shape: the HF Qwen2's, or the tiny LM's."""
    mcfg = policy_cfg["megatron_cfg"]
    precision = policy_cfg["precision"]
    fields = {
        "tensor_model_parallel_size": mcfg["tensor_model_parallel_size"],
        "pipeline_model_parallel_size": mcfg["pipeline_model_parallel_size"],
        "context_parallel_size": mcfg["context_parallel_size"],
        "sequence_parallel": mcfg["sequence_parallel"] and mcfg["tensor_model_parallel_size"] > 1,
        "calculate_per_token_loss": True,  # setup.py line 940: NeMo-RL scales the loss itself
        "perform_initialization": True,
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,  # a CUDA kernel
        "bf16": precision == "bfloat16",
        "fp16": precision == "float16",
        "params_dtype": {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(precision, torch.float32),
        "pipeline_dtype": torch.float32,
    }
    if hf_config is not None:
        return megatron_gpt.transformer_config(hf_config, **fields)
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=8, **fields)


def hf_checkpoint_config(model_dir: str):
    """The HF config of an HF checkpoint (trained as megatron-core's GPTModel); None for the tiny LM."""
    if (Path(model_dir) / WEIGHTS_FILE).exists():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _policy_model(model_dir: str, config: TransformerConfig, hf_config):
    """The model a worker trains, holding the checkpoint's weights: an HF Qwen2 in megatron-core's GPTModel
    (what Megatron-Bridge builds on the cluster), or the tiny LM in Megatron's layout."""
    if hf_config is None:
        full = load_weights(model_dir)
        module = TinyParallelLM(config, full["embedding.weight"].shape[0], full["position_embedding.weight"].shape[0])
        module.load_full(full)
        return module
    if config.tensor_model_parallel_size != 1 or config.context_parallel_size != 1:
        raise NotImplementedError(
            "GPTModel on CPU runs at TP 1 and CP 1 only: the weight conversion is the unsplit one, and "
            "context-parallel attention is a Transformer Engine kernel (the tiny LM rehearses those layouts)")
    from safetensors.torch import load_file

    module = Qwen2GPTModel(config, hf_config)
    module.load_full(load_file(str(Path(model_dir) / "model.safetensors")))
    return module


class Qwen2GPTModel(GPTModel):
    """megatron-core's GPTModel (local layer spec) holding an HF Qwen2, with the tiny LM's two hand-overs:
    `load_full` takes HF-named weights, `gather_full` gives them back in HF names (the refit's, which the
    real engine loads). tests/support/megatron_gpt.py converts; Megatron-Bridge does on the cluster."""

    def __init__(self, config: TransformerConfig, hf_config):
        super().__init__(config, **megatron_gpt.gpt_model_kwargs(hf_config))
        self.hf_config = hf_config

    def load_full(self, hf: dict[str, torch.Tensor]) -> None:
        megatron_gpt.load_hf(self, hf, self.hf_config)

    @torch.no_grad()
    def gather_full(self) -> dict[str, torch.Tensor]:
        return megatron_gpt.hf_from_megatron(self.state_dict(), self.hf_config)


def _optimizer_config(policy_cfg: dict) -> OptimizerConfig:
    """`OptimizerConfig(**megatron_cfg.optimizer, overlap_param_gather=...)` as `_create_megatron_config`,
    keeping the fields megatron-core 0.16.1's OptimizerConfig has."""
    import dataclasses

    mcfg = policy_cfg["megatron_cfg"]
    known = {f.name for f in dataclasses.fields(OptimizerConfig)}
    kwargs = {k: v for k, v in mcfg["optimizer"].items() if k in known}
    kwargs["overlap_param_gather"] = mcfg["distributed_data_parallel_config"]["overlap_param_gather"]
    return OptimizerConfig(**kwargs)


def _ddp_config(policy_cfg: dict) -> DistributedDataParallelConfig:
    """`_create_megatron_config`'s DistributedDataParallelConfig."""
    mcfg = policy_cfg["megatron_cfg"]
    ddp = mcfg["distributed_data_parallel_config"]
    return DistributedDataParallelConfig(
        check_for_nan_in_grad=True,
        grad_reduce_in_fp32=ddp["grad_reduce_in_fp32"],
        overlap_grad_reduce=ddp["overlap_grad_reduce"],
        overlap_param_gather=ddp["overlap_param_gather"],
        average_in_collective=False,  # required with calculate_per_token_loss
        use_distributed_optimizer=mcfg["optimizer"]["use_distributed_optimizer"],
        data_parallel_sharding_strategy=ddp["data_parallel_sharding_strategy"],
    )


def _scheduler(policy_cfg: dict, optimizer) -> OptimizerParamScheduler:
    """Bridge's `_get_scheduler` after `ConfigContainer` turned iterations into samples (x global batch)."""
    mcfg, gbs = policy_cfg["megatron_cfg"], policy_cfg["train_global_batch_size"]
    sched, opt = mcfg["scheduler"], mcfg["optimizer"]
    decay = (sched.get("lr_decay_iters") or mcfg["train_iters"]) * gbs
    return OptimizerParamScheduler(
        optimizer,
        init_lr=sched["lr_warmup_init"],
        max_lr=opt["lr"],
        min_lr=opt["min_lr"],
        lr_warmup_steps=min(sched["lr_warmup_iters"] * gbs, decay - 1),
        lr_decay_steps=decay,
        lr_decay_style=sched["lr_decay_style"],
        start_wd=sched["start_weight_decay"],
        end_wd=sched["end_weight_decay"],
        wd_incr_steps=mcfg["train_iters"] * gbs,
        wd_incr_style=sched["weight_decay_incr_style"],
    )


class CPUMegatronPolicyWorkerImpl(MegatronPolicyWorkerImpl):
    """MegatronPolicyWorkerImpl with a CPU `__init__` (see the module docstring); upstream methods otherwise."""

    def __init__(
        self,
        config,
        tokenizer,
        weights_path=None,
        optimizer_path=None,
        init_optimizer=True,
        init_reference_model=True,
        *,
        worker_sharding_annotations,
        **kwargs: Any,
    ):
        torch.set_num_threads(1)  # 8 ranks share the machine's cores
        if init_reference_model:
            raise NotImplementedError("the rehearsal runs without a KL term (no reference model)")
        self.cfg = config
        self._router_replay_enabled = False
        self.rank = int(os.environ.get("RANK", "0"))
        mcfg = config["megatron_cfg"]

        # Step 1: distributed -- gloo instead of NCCL, megatron-core's real parallel state.
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=mcfg["tensor_model_parallel_size"],
            pipeline_model_parallel_size=mcfg["pipeline_model_parallel_size"],
            context_parallel_size=mcfg["context_parallel_size"],
        )
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)  # Bridge's `_set_random_seed`: GPTModel's attention forks it

        # Steps 2-3: model paths and the runtime config (setup.py `validate_and_set_config`).
        self.tokenizer = tokenizer
        generation = config.get("generation") or {}
        self.is_generation_colocated = generation.get("colocated", {}).get("enabled", True)
        self.sampling_params = TrainingSamplingParams(
            top_k=generation.get("top_k"), top_p=generation.get("top_p", 1.0),
            temperature=generation.get("temperature", 1.0),
        )
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(config["precision"], torch.float32)
        self.optimizer_cpu_offload = mcfg["optimizer"]["optimizer_cpu_offload"]
        self.offload_optimizer_for_logprob = config["offload_optimizer_for_logprob"]
        self.defer_fp32_logits = False
        self.fp8_cfg = mcfg.get("fp8_cfg", None)
        hf_config = hf_checkpoint_config(config["model_name"])
        model_config = _transformer_config(config, hf_config)
        self.megatron_cfg = SimpleNamespace(
            model=model_config,
            optimizer=_optimizer_config(config),
            ddp=_ddp_config(config),
            checkpoint=SimpleNamespace(
                save=weights_path, load=weights_path, load_optim=optimizer_path is not None,
                async_save=bool((mcfg.get("checkpoint") or {}).get("async_save", False)),  # main's key
            ),
        )

        # Step 4: model, optimizer, scheduler (setup.py `setup_model_and_optimizer`).
        module = _policy_model(config["model_name"], model_config, hf_config)
        self.final_padded_vocab_size = module.output_layer.weight.shape[0] * mcfg["tensor_model_parallel_size"]
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.model = DistributedDataParallel(
            model_config, self.megatron_cfg.ddp, module, pg_collection=pg_collection
        )
        self.optimizer = get_megatron_optimizer(self.megatron_cfg.optimizer, [self.model]) if init_optimizer else None
        self.scheduler = _scheduler(config, self.optimizer) if init_optimizer else None
        self.mcore_state = SimpleNamespace(
            cfg=self.megatron_cfg,
            straggler_timer=StragglerDetector(),
            train_state=SimpleNamespace(step=0, floating_point_operations_so_far=0),
        )
        self.checkpointing_context = {}
        self.draft_model = None
        if weights_path is not None and megatron_cpu.checkpoint_exists(weights_path):
            load_optimizer = init_optimizer and optimizer_path is not None
            megatron_cpu.load_checkpoint(
                self.mcore_state, [self.model],
                self.optimizer if load_optimizer else None,
                self.scheduler if load_optimizer else None,
            )

        # Step 6: finalize (setup.py `finalize_megatron_setup` -> Bridge's `_update_model_config_funcs`).
        ddp_cfg = self.megatron_cfg.ddp
        if ddp_cfg.overlap_grad_reduce:
            model_config.no_sync_func = self.model.no_sync
            model_config.grad_sync_func = self.model.start_grad_sync
        if ddp_cfg.overlap_param_gather and ddp_cfg.align_param_gather:
            model_config.param_sync_func = self.model.start_param_sync
        if self.optimizer is not None:
            model_config.finalize_model_grads_func = partial(_finalize_model_grads, worker=self)
            model_config.grad_scale_func = self.optimizer.scale_loss
        self.dp_size = worker_sharding_annotations.get_axis_size("data_parallel")
        self.should_disable_forward_pre_hook = (
            mcfg["optimizer"]["use_distributed_optimizer"]
            and mcfg["distributed_data_parallel_config"]["overlap_param_gather"]
        )
        self._first_train_step_forward_pre_hook_disabled = False
        self._first_train_step_param_sync_func = None
        if self.should_disable_forward_pre_hook and self._forward_pre_hook_enabled():
            self._disable_forward_pre_hook_until_next_train_step()
        self.delegate_pack_to_model = False
        self.refit_conversion_tasks = None
        self.refit_conversion_tasks_current_index = None
        self.refit_param_info_mcore = None
        self._held_gather_buffer = None
        self._init_inference_engine_state()
        self._set_what_main_reads(config)

        self.recorder = Recorder.from_env(self)
        if self.recorder:
            self.recorder.write("init", {
                "weights_path": weights_path, "optimizer_path": optimizer_path,
                "params": self.local_params(), "optimizer": self.optimizer_summary(),
            })

    # -- what the GPU-only helpers of the real worker do, on CPU ---------------------------------------
    def _set_what_main_reads(self, config: dict) -> None:
        """NeMo-RL main's `__init__` and runtime config set more than v0.7.0's, and its `train`, `get_logprobs`
        and offload methods read them: each as upstream derives it for this model (its own helpers where the
        installed worker module has them), and what they are for a DDP-wrapped dense model otherwise."""
        upstream = sys.modules[MegatronPolicyWorkerImpl.__module__]

        def derived(helper: str, default: Any) -> Any:
            return getattr(upstream, helper)(self.model) if hasattr(upstream, helper) else default

        self.timer = Timer()  # main labels it with its worker and rank (Timer(context=...)); v0.7.0 has none
        self.offload_optimizer_for_refit = bool(config.get("offload_optimizer_for_refit", True))
        self.delegate_mtp_loss_mask_to_model = derived("_model_self_packs_mtp_loss_mask", False)
        self.model_slices_context_parallel_inputs = derived("_model_slices_context_parallel_inputs", False)
        accepts_media_mask = derived("_model_accepts_media_token_validity_mask", False)
        self.media_placeholder_token_id = derived("_model_media_placeholder_token_id", None) if accepts_media_mask else None
        # no Megatron inference model, reshard plan or NIXL agent (the generation is vLLM's stand-in)
        self.inference_model = self._colocated_reshard_plan = self._nixl_preinit_agent = None
        self._swap_weights_plan_prepared = self._inference_model_offloaded = False

    def get_free_memory_bytes(self) -> int:
        return 8 << 30

    def shutdown(self) -> bool:
        """Upstream's cleanup, then the multiprocessing Manager megatron-core's checkpoint writer starts
        for its results queue (dist_checkpointing/strategies/filesystem_async.py): Ray kills the actor
        next, which would orphan that server process."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        queue = filesystem_async._results_queue
        if queue is not None:
            queue._manager.shutdown()
            filesystem_async._results_queue = None
        return super().shutdown()

    def prepare_refit_info(self):
        full = self.model.module.gather_full()
        return {name: (t.shape, t.dtype) for name, t in full.items()}

    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int = 0, kv_scales=None):
        full = self.model.module.gather_full()  # collective over TP: every rank takes part
        if torch.distributed.get_rank() == 0:
            # The weights' version: optimizer steps taken (the LR scheduler counts samples; it is
            # checkpointed, so the count goes on across a resume).
            steps = self.scheduler.num_steps // self.cfg["train_global_batch_size"]
            refit_mailbox.post(full, steps)

    # Non-colocated generation: upstream opens an NCCL group over the trainer's and the generation
    # engines' ranks and broadcasts the weights in it; here they go through the same mailbox.
    def init_collective(self, ip, port, world_size, *, train_world_size, **kwargs):
        return None

    def broadcast_weights_for_collective(self, kv_scales=None, **kwargs):
        self.stream_weights_via_ipc_zmq(kv_scales=kv_scales)

    # -- instrumentation around upstream's methods (they run unchanged inside) -------------------------
    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, check_dim_skip_keys=None):
        loss_fn = FaultInTheMiddle(loss_fn, torch.distributed.get_rank())  # tests/support/nemo_faults.py
        if self.recorder:
            loss_fn = self.recorder.loss_recorder(loss_fn)
        result = super().train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs,
                               check_dim_skip_keys=check_dim_skip_keys)
        if self.recorder:
            self.recorder.write("train", {"loss_calls": loss_fn.calls, "data": dict(data),
                                          "lr": self.scheduler.get_lr(self.optimizer.param_groups[0])})
        return result

    def get_logprobs(self, *, data, micro_batch_size=None, require_router_replay=True):
        result = super().get_logprobs(data=data, micro_batch_size=micro_batch_size,
                                      require_router_replay=require_router_replay)
        if self.recorder:
            self.recorder.write("logprobs", {"data": dict(data), "logprobs": result["logprobs"]})
        return result

    def save_checkpoint(self, weights_path, optimizer_path=None, **kwargs):
        reached("policy.save_checkpoint", torch.distributed.get_rank())  # tests/support/nemo_faults.py
        super().save_checkpoint(weights_path, optimizer_path=optimizer_path, **kwargs)
        if self.recorder:
            # an asynchronous save is still being written when save_checkpoint returns (finalize_async_save
            # completes it); a synchronous one is done
            pending = megatron_cpu._ASYNC_CALLS[0].get_num_unfinalized_calls() if megatron_cpu._ASYNC_CALLS else 0
            self.recorder.write("save", {"weights_path": weights_path, "optimizer_path": optimizer_path,
                                         "params": self.local_params(), "optimizer": self.optimizer_summary(),
                                         "pending_writes": pending})

    def local_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.module.named_parameters()}

    def optimizer_summary(self) -> dict[str, Any]:
        """The optimizer's own state on this rank: Adam's step and moments of the parameter shard it
        owns (the inner torch optimizer of each part of megatron-core's chained optimizer)."""
        if self.optimizer is None:
            return {}
        moments = []
        for part in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    state = inner.state.get(param, {})
                    moments.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                    for k, v in sorted(state.items())})
        return {"moments": moments, "lr": self.scheduler.get_lr(self.optimizer.param_groups[0])}

    def coords(self) -> dict[str, int]:
        return {
            "rank": torch.distributed.get_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "cp": parallel_state.get_context_parallel_rank(),
            "tp": parallel_state.get_tensor_model_parallel_rank(),
        }


def _finalize_model_grads(model, *args, worker, **kwargs):
    """megatron-core's `finalize_model_grads` (Bridge sets it as `config.finalize_model_grads_func`), with
    the recorder reading the weights and the DP x CP-reduced gradients right after it (before the
    optimizer step)."""
    finalize_model_grads(model, *args, **kwargs)
    if worker.recorder:
        worker.recorder.write("grads", {"params": worker.local_params(), "grads": reduced_grads(worker.model)})


def reduced_grads(ddp: DistributedDataParallel) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as megatron-core reduced it over DP x CP. With the distributed optimizer
    the reduce-scatter leaves each rank only its shard of every bucket reduced; the shards are gathered
    here (instrumentation: the optimizer itself only reads its own shard)."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    out = {}
    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for bucket in group.buckets:
            data = bucket.grad_data
            if ddp.ddp_config.use_distributed_optimizer:
                comm = group.intra_distributed_optimizer_instance_group
                size, rank = torch.distributed.get_world_size(comm), torch.distributed.get_rank(comm)
                shard = data.numel() // size
                full = torch.empty_like(data)
                torch.distributed.all_gather_into_tensor(
                    full, data[rank * shard : (rank + 1) * shard].contiguous(), group=comm
                )
            else:
                full = data.clone()
            for param in bucket.params:
                # main_grad is the parameter's view into the bucket (the buffer pads between parameters)
                start = param.main_grad.storage_offset() - data.storage_offset()
                out[names[param]] = full[start : start + param.numel()].view(param.shape).clone()
    return out


class Recorder:
    """Writes what the worker's upstream methods saw, per rank, for the tests (see the module docstring).
    Files are numbered on from the ones already there, so a resumed run's records follow the first's."""

    def __init__(self, worker, directory: Path):
        self.worker, self.directory = worker, directory
        self.seq = len(list(directory.glob("*.pt")))

    @classmethod
    def from_env(cls, worker):
        root = os.environ.get(RECORD_DIR_ENV)
        if not root:
            return None
        directory = Path(root) / "policy" / f"rank{torch.distributed.get_rank()}"
        directory.mkdir(parents=True, exist_ok=True)
        return cls(worker, directory)

    def write(self, kind: str, payload: dict) -> None:
        payload = {"kind": kind, "coords": self.worker.coords(), **payload}
        torch.save(payload, self.directory / f"{self.seq:05d}_{kind}.pt")
        self.seq += 1

    def loss_recorder(self, loss_fn):
        return RecordingLoss(loss_fn)


class RecordingLoss:
    """Passes every call through to the loss and keeps what it received and returned."""

    def __init__(self, loss_fn):
        self.loss_fn, self.calls = loss_fn, []

    def __getattr__(self, name):
        return getattr(self.loss_fn, name)

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks, **kwargs):
        loss, metrics = self.loss_fn(
            next_token_logprobs=next_token_logprobs, data=data, global_valid_seqs=global_valid_seqs,
            global_valid_toks=global_valid_toks, **kwargs,
        )
        self.calls.append({
            "data": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in data.items()},
            "logprobs": next_token_logprobs.detach().clone(),
            "global_valid_toks": float(global_valid_toks),
            "global_valid_seqs": float(global_valid_seqs),
            "loss": float(loss.detach()),
            "metrics": dict(metrics),
        })
        return loss, metrics


@ray.remote
class CPUMegatronPolicyWorker(CPUMegatronPolicyWorkerImpl):
    """The Ray actor `Policy(worker_extension_cls_fqn="tests.support.nemo_megatron_standins.CPUMegatronPolicyWorker")`
    builds (upstream's `MegatronPolicyWorker` is `ray.remote(MegatronPolicyWorkerImpl)` the same way)."""
