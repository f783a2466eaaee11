"""Test fixtures: CPU stand-ins for NeMo-RL v0.7.0's two GPU worker groups.

`python -m bapo_nemo.train` runs NeMo-RL's real `setup()` and `grpo_train`/`async_grpo_train` on CPU in
the tests; only what cannot run here is replaced, at that boundary and nowhere else:
- `nemo_rl.algorithms.grpo.Policy` (DTensor/Megatron training workers on GPUs) -> `CPUPolicyStandIn`,
- `nemo_rl.algorithms.grpo.VllmGeneration` (vLLM workers on GPUs) -> `CPUGenerationStandIn`.
Both hold a tiny Qwen2 in the driver process. Everything else (Ray and its placement groups, data
processing, the math environment's Ray actors, the advantage estimator, the Logger writing to MLflow,
the CheckpointManager, the loss) is NeMo-RL's own code.

The stand-in policy's `train()` follows v0.7.0's DTensor worker (`nemo_rl/models/policy/workers/
dtensor_policy_worker.py`, `DTensorPolicyWorker.train`, lines 579-990) with one data-parallel rank:
the same global-batch split, `global_valid_seqs`/`global_valid_toks` over the global batch, NeMo-RL's
own `prepare_loss_input` for the loss's inputs, the same per-micro-batch metric scaling and the same
result dict; `Policy.train` (`nemo_rl/models/policy/lm_policy.py`, lines 702-793) then aggregates
`all_mb_metrics` as lists, which this class returns directly.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
from nemo_rl.algorithms.loss.interfaces import LossInputType
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.interfaces import ColocatablePolicyInterface
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.embedded.tokenizer import build_tokenizer

# Plain concatenation: the tiny tokenizer has no chat template of its own.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

# The driver process holds both stand-ins; "refit" hands the policy's weights to the generator here.
_REFIT: dict[str, dict[str, torch.Tensor]] = {}
# Every train() call's data and loss metrics, for the tests to inspect (the loss's own inputs).
TRAIN_CALLS: list[dict[str, Any]] = []
# Every policy construction's weights/optimizer paths (resume loads them) and every generated prompt.
POLICY_INITS: list[dict[str, Any]] = []
GENERATED_PROMPTS: list[list[int]] = []
# Every sampled segment: its context, new tokens, their log-probs, and the generator's weight version
# (refits so far, counted across driver runs in this process so a resumed run's versions stay distinct).
SEGMENTS: list[dict[str, Any]] = []
WEIGHT_VERSION = [0]
# Called at the start of every train(), e.g. to deliver a signal "during step N".
ON_TRAIN: list[Any] = []


def write_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen2 over the embedded character tokenizer, saved as an HF checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def write_math_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    """Single-digit sums: the math environment's verifier extracts the response's last number."""
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(0, 4), rng.randint(0, 5)
            f.write(json.dumps({"input": f"{a}+{b}=?", "output": str(a + b)}) + "\n")
    return path


def prepare_loss_input_cpu(logits, data, loss_fn, sampling_params=None):
    """v0.7.0's `nemo_rl.algorithms.loss.utils.prepare_loss_input` (lines 37-117) for a plain tensor.

    Re-implemented because its plain-tensor branch, `nemo_rl.distributed.model_utils.
    get_next_token_logprobs_from_logits` (lines 1624-1639), moves the targets to CUDA. Same maths:
    log-softmax of logits[:, :-1], gathered at input_ids[:, 1:]; top-k/top-p filtering is not modelled."""
    if loss_fn.input_type != LossInputType.LOGPROB:
        raise NotImplementedError(f"the CPU stand-in computes log-prob inputs only, not {loss_fn.input_type}")
    if sampling_params is not None and (sampling_params.top_k or (sampling_params.top_p or 1.0) < 1.0):
        raise NotImplementedError("top-k/top-p filtered training log-probs are not modelled on CPU")
    lp = torch.log_softmax(logits[:, :-1], dim=-1)
    lp = lp.gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return {"next_token_logprobs": lp}, data


def _token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, S] log-probs of each token given its prefix, 0 at position 0 (v0.7.0's convention)."""
    logits = model(input_ids=input_ids, use_cache=False).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


class CPUPolicyStandIn(ColocatablePolicyInterface):
    """NeMo-RL's `Policy` on one CPU rank (see the module docstring for what it follows)."""

    def __init__(
        self,
        cluster=None,
        config=None,
        tokenizer=None,
        processor=None,
        weights_path=None,
        optimizer_path=None,
        init_optimizer=True,
        init_reference_model=False,
        **_: Any,
    ):
        self.cfg = config
        self.tokenizer = tokenizer
        POLICY_INITS.append({"weights_path": weights_path, "optimizer_path": optimizer_path})
        source = weights_path if weights_path else config["model_name"]
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        lr = float(config.get("optimizer", {}).get("kwargs", {}).get("lr", 1e-3))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        if optimizer_path and os.path.exists(os.path.join(optimizer_path, "optim.pt")):
            self.optimizer.load_state_dict(torch.load(os.path.join(optimizer_path, "optim.pt")))
        self.max_grad_norm = config.get("max_grad_norm")
        gen = config.get("generation") or {}
        self.sampling_params = TrainingSamplingParams(
            top_k=gen.get("top_k"), top_p=gen.get("top_p", 1.0), temperature=gen.get("temperature", 1.0)
        )
        self.temperature = float(gen.get("temperature", 1.0))

    # -- log-probs -------------------------------------------------------------------------------
    @torch.no_grad()
    def get_logprobs(self, data: BatchedDataDict, timer=None, micro_batch_size=None) -> BatchedDataDict:
        self.model.eval()
        lp = _token_logprobs(self.model, data["input_ids"], self.temperature)
        # v0.7.0 zeroes positions past each sequence's length (dtensor_policy_worker.py, lines 1260-1270).
        positions = torch.arange(lp.shape[1]).unsqueeze(0)
        lp = lp * (positions < data["input_lengths"].unsqueeze(1))
        return BatchedDataDict({"logprobs": lp})

    def get_reference_policy_logprobs(self, data, micro_batch_size=None, timer=None):
        raise NotImplementedError("the tests run with reference_policy_kl_penalty: 0 (no reference model)")

    def get_topk_logits(self, *args, **kwargs):
        raise NotImplementedError("distillation is not exercised")

    # -- training --------------------------------------------------------------------------------
    def train(
        self, data: BatchedDataDict, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None,
        check_dim_skip_keys=None,
    ) -> dict[str, Any]:
        for hook in ON_TRAIN:
            hook()
        gbs = gbs or self.cfg["train_global_batch_size"]
        mbs = mbs or self.cfg["train_micro_batch_size"]
        num_global_batches = data.size // gbs  # dtensor_policy_worker.py line 594 (dp_size 1)
        self.model.train(not eval_mode)
        losses, all_mb_metrics, grad_norm = [], [], None
        prepare = partial(prepare_loss_input_cpu, sampling_params=self.sampling_params)
        for gb_idx in range(num_global_batches):
            batch = data.get_batch(batch_idx=gb_idx, batch_size=gbs)
            # lines 638-654: normalisers over the whole global batch, token_mask from position 1
            global_valid_seqs = torch.sum(batch["sample_mask"])
            global_valid_toks = torch.sum(batch["token_mask"][:, 1:] * batch["sample_mask"].unsqueeze(-1))
            self.optimizer.zero_grad()
            mb_losses = []
            for mb in batch.make_microbatch_iterator(mbs):  # line 686 (no packing, no dynamic batching)
                with torch.set_grad_enabled(not eval_mode):
                    logits = self.model(input_ids=mb["input_ids"], use_cache=False).logits.float()
                    loss_input, mb = prepare(logits, mb, loss_fn)  # lines 879-898
                    loss, loss_metrics = loss_fn(
                        data=mb, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                        **loss_input,
                    )
                TRAIN_CALLS.append({
                    "data": mb, "metrics": dict(loss_metrics), "global_valid_toks": float(global_valid_toks),
                    "logprobs": loss_input["next_token_logprobs"].detach().clone(),
                })
                # lines 909-918: scale by the number of global batches, except *_min/*_max
                for k in loss_metrics:
                    if "_min" in k or "_max" in k:
                        continue
                    loss_metrics[k] /= num_global_batches
                num_valid_samples = loss_metrics["num_valid_samples"]
                loss_metrics["lr"] = self.optimizer.param_groups[0]["lr"]
                loss_metrics["global_valid_seqs"] = global_valid_seqs.item()
                loss_metrics["global_valid_toks"] = global_valid_toks.item()
                if not eval_mode:
                    loss.backward()
                if num_valid_samples > 0:
                    mb_losses.append(loss.item())
                    all_mb_metrics.append(loss_metrics)
            if not eval_mode:  # lines 935-953
                norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.max_grad_norm if self.max_grad_norm else float("inf")
                )
                grad_norm = torch.tensor([float(norm)])
                self.optimizer.step()
            losses.append(torch.tensor(mb_losses).sum().item())
        self.optimizer.zero_grad()
        mb_metrics = defaultdict(list)  # lines 971-975, then lm_policy.py 787-791
        for m in all_mb_metrics:
            for k, v in m.items():
                mb_metrics[k].append(v)
        return {"loss": torch.tensor(losses), "grad_norm": grad_norm, "all_mb_metrics": dict(mb_metrics)}

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, weights_path, optimizer_path=None, tokenizer_path=None, **_: Any) -> None:
        self.model.save_pretrained(weights_path)
        if optimizer_path:
            os.makedirs(optimizer_path, exist_ok=True)
            torch.save(self.optimizer.state_dict(), os.path.join(optimizer_path, "optim.pt"))
        if tokenizer_path:
            self.tokenizer.save_pretrained(tokenizer_path)

    # -- refit (colocated: the weights go to the generator through _REFIT) -----------------------
    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int = 0, kv_scales=None) -> list:
        _REFIT["weights"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return []

    def broadcast_weights_for_collective(self, kv_scales=None) -> list:
        return self.stream_weights_via_ipc_zmq()

    def stream_weights_via_http(self, *args, **kwargs):
        raise NotImplementedError("SGLang is not exercised")

    def print_node_ip_and_gpu_id(self) -> list:
        return []

    def get_free_memory_bytes(self) -> int:
        return 1 << 30

    def prepare_refit_info(self):
        return {}

    def init_collective(self, *args, **kwargs) -> list:
        return []

    def set_rollout_num_gpus_per_engine(self, num_gpus_per_engine: int) -> None:
        pass

    def calibrate_qkv_fp8_scales(self, *args, **kwargs):
        raise NotImplementedError("FP8 KV scales need GPUs")

    def prepare_for_training(self, *args, **kwargs) -> None:
        pass

    def prepare_for_lp_inference(self, *args, **kwargs) -> None:
        pass

    def finish_training(self, *args, **kwargs) -> None:
        pass

    def offload_before_refit(self) -> None:
        pass

    def offload_after_refit(self) -> None:
        pass

    def shutdown(self) -> bool:
        return True


class CPUGenerationStandIn(GenerationInterface):
    """vLLM's place: samples from its own copy of the tiny model; refit copies the policy's weights."""

    def __init__(self, cluster=None, config=None, **_: Any):
        self.cfg = config
        self.model = AutoModelForCausalLM.from_pretrained(config["model_name"], dtype=torch.float32)
        self.model.eval()
        self.generator = torch.Generator().manual_seed(1234)

    @torch.no_grad()
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        max_new = int(self.cfg["max_new_tokens"])
        pad, stops = int(self.cfg["_pad_token_id"]), set(self.cfg.get("stop_token_ids") or [])
        temperature = float(self.cfg.get("temperature", 1.0))
        rows, lps, gen_lens = [], [], []
        for i in range(input_ids.shape[0]):
            seq = input_ids[i, : int(input_lengths[i])].tolist()
            GENERATED_PROMPTS.append(list(seq))
            n_in, seq_lp = len(seq), []
            while len(seq) - n_in < max_new:
                logits = self.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                probs = torch.softmax(logits / temperature, dim=-1)
                tok = int(probs.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=self.generator))
                seq.append(tok)
                seq_lp.append(float(torch.log(probs[tok])))
                if tok in stops:
                    break
            SEGMENTS.append({"context": seq[:n_in], "tokens": seq[n_in:], "logprobs": seq_lp,
                             "version": WEIGHT_VERSION[0]})
            rows.append(seq)
            lps.append([0.0] * n_in + seq_lp)
            gen_lens.append(len(seq) - n_in)
        width = max(len(r) for r in rows)
        output_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width))
        for i, (r, lp) in enumerate(zip(rows, lps)):
            output_ids[i, : len(r)] = torch.tensor(r)
            logprobs[i, : len(lp)] = torch.tensor(lp)
        gen_lens_t = torch.tensor(gen_lens)
        return BatchedDataDict(
            {
                "output_ids": output_ids,
                "logprobs": logprobs,
                "generation_lengths": gen_lens_t,
                "unpadded_sequence_lengths": input_lengths + gen_lens_t,
                "truncated": torch.tensor([g >= max_new and r[-1] not in stops for g, r in zip(gen_lens, rows)]),
            }
        )

    def update_weights_via_ipc_zmq(self) -> list:
        self.model.load_state_dict(_REFIT["weights"])
        WEIGHT_VERSION[0] += 1
        return [ray.put(True)]

    def update_weights_from_collective(self) -> list:
        return self.update_weights_via_ipc_zmq()

    def init_collective(self, *args, **kwargs) -> list:
        return []

    def prepare_for_generation(self, *args, **kwargs) -> bool:
        return True

    def finish_generation(self, *args, **kwargs) -> bool:
        return True

    def prepare_refit_info(self, state_dict_info) -> None:
        pass

    def invalidate_kv_cache(self) -> bool:
        return True

    @property
    def requires_kv_scale_sync(self) -> bool:
        return False

    def clear_logger_metrics(self) -> None:
        pass

    def get_logger_metrics(self) -> dict[str, Any]:
        return {}

    def snapshot_step_metrics(self) -> None:
        pass

    def get_step_metrics(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> bool:
        return True
