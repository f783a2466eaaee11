"""Test fixtures: a CPU stand-in for NeMo-RL's GPU training workers, the tiny model and data the driver e2e
tests train, and a record of what the real vLLM engine returned.

`python -m bapo_nemo.train` runs NeMo-RL's real `setup()` and `grpo_train`/`async_grpo_train` on CPU in
the tests; only what cannot run here is replaced, at that boundary and nowhere else:
`nemo_rl.algorithms.grpo.Policy` (DTensor/Megatron training workers on GPUs) -> `CPUPolicyStandIn`, which
holds a tiny Qwen2 in the driver process. Generation is NeMo-RL's own `VllmGeneration` on the real engine
(tests/support/nemo_vllm_worker.py), which loads the stand-in policy's refit from a file
(`stream_weights_via_ipc_zmq`); `RecordingVllmGeneration` notes what it returned. Everything else (Ray and
its placement groups, data processing, the math environment's Ray actors, the advantage estimator, the
Logger writing to MLflow, the CheckpointManager, the async loop's collector and replay buffer, the loss) is
NeMo-RL's own code.

Weight versions: the policy counts its train() calls (saved with its weights, so a resumed policy continues
the count) and every refit hands that count over with the weights, so each recorded segment carries the
policy version that produced it (the partial-rollout hook's numbering).

The stand-in policy's `train()` follows v0.7.0's DTensor worker (`nemo_rl/models/policy/workers/
dtensor_policy_worker.py`, `DTensorPolicyWorker.train`, lines 579-990) with one data-parallel rank:
the same global-batch split, `global_valid_seqs`/`global_valid_toks` over the global batch, NeMo-RL's
own `prepare_loss_input` for the loss's inputs, the same per-micro-batch metric scaling and the same
result dict; `Policy.train` (`nemo_rl/models/policy/lm_policy.py`, lines 702-793) then aggregates
`all_mb_metrics` as lists, which this class returns directly.
"""

from __future__ import annotations

import copy
import json
import os
import random
import threading
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
from nemo_rl.algorithms.loss.interfaces import LossInputType
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.named_sharding import NamedSharding
from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration
from nemo_rl.models.policy.interfaces import ColocatablePolicyInterface
from nemo_rl.models.policy.lm_policy import Policy
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.embedded.model.tokenizer import build_tokenizer
from tests.support.vllm_engine import REFIT_FILE_ENV

# Plain concatenation: the tiny tokenizer has no chat template of its own.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

# The driver process holds the policy; "refit" hands its weights (and their version) to the generator here.
_REFIT: dict[str, Any] = {}
# Every train() call's data and loss metrics, for the tests to inspect (the loss's own inputs).
TRAIN_CALLS: list[dict[str, Any]] = []
# Every policy construction's weights/optimizer paths (resume loads them) and every generated prompt.
POLICY_INITS: list[dict[str, Any]] = []
GENERATED_PROMPTS: list[list[int]] = []
# The weights paths of asynchronous saves, in the order their writers were waited for.
ASYNC_SAVES_FINALIZED: list[str] = []
# Every segment the engine returned to the driver: its context, new tokens, their log-probs, and the policy
# version of the weights that sampled it (train() calls those weights had seen).
SEGMENTS: list[dict[str, Any]] = []
# The policy stand-in's version, saved beside its weights in every checkpoint.
VERSION_FILE = "standin_policy_version.json"
# Called at the start of every train(), e.g. to deliver a signal "during step N".
ON_TRAIN: list[Any] = []


# The tests' premise: a GRPO group of the warm-started model holds a right AND a wrong answer, so its
# advantages are non-zero and BAPO's bound search has both signs to weigh, on any machine.
# - The tiny model is taught, for each of the 30 prompts, two answers at 50% each: the sum (rewarded) and
#   the sum + 1 (not). Full-batch training on all 60 rows converges to that fixed point whatever the CPU's
#   float reductions (measured: every prompt's two responses within [0.49, 0.50], see _warm_start);
#   check_mixed_answers asserts >= MIN_ANSWER_PROB for both after every warm start.
# - The engine draws a group's samples independently: a group of G is uniform with probability at most
#   2 (1 - MIN_ANSWER_PROB)^G, 1.1e-8 for G = 32 (MIXED_GROUP_SIZE), the group size of the tests that need
#   the premise.
MIN_ANSWER_PROB = 0.45
MIXED_GROUP_SIZE = 32


def math_prompts() -> list[tuple[int, int]]:
    """Every single-digit sum the tiny model knows: a in 0..4, b in 0..5 (30 prompts)."""
    return [(a, b) for a in range(5) for b in range(6)]


def wrong_answer(a: int, b: int) -> int:
    """The wrong answer the tiny model gives half the time: one digit off, same length as the right one."""
    return (a + b + 1) % 10


def write_tiny_model(directory: Path, seed: int = 0, warm_start_steps: int = 400) -> Path:
    """A 2-layer Qwen2 over the embedded character tokenizer, saved as an HF checkpoint.

    It is first taught the answer format ("a+b=c", then EOS) with c the sum or `wrong_answer` at 50% each,
    for every prompt of `math_prompts` (see the premise above), then checked (`check_mixed_answers`). An
    untrained model is never rewarded, and with all advantages 0 every search returns its starting bounds
    whatever the ratio."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = Qwen2Config(  # head_dim 32: the smallest vLLM's CPU attention takes
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    _warm_start(model, tokenizer, warm_start_steps)
    check_mixed_answers(model, tokenizer)
    model.save_pretrained(directory)
    return directory


def _answer_rows(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """For every prompt "a+b=?": the rows prompt + "a+b=<sum>" + EOS and prompt + "a+b=<wrong>" + EOS
    (right first), right-padded, with labels on the response only."""
    rows = []
    for a, b in math_prompts():
        prompt = tokenizer.encode(f"{a}+{b}=?", add_special_tokens=False)
        for answer in (a + b, wrong_answer(a, b)):
            response = tokenizer.encode(f"{a}+{b}={answer}", add_special_tokens=False)
            rows.append((prompt, response + [tokenizer.eos_token_id]))
    width = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, r) in enumerate(rows):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    return input_ids, labels


def _warm_start(model, tokenizer, steps: int, lr: float = 1e-2, warmup: int = 40) -> None:
    """Full-batch AdamW on all 60 rows of `_answer_rows` (no sampling noise in the target), the learning
    rate warmed up linearly and decayed to 0 on a cosine, so the model settles at the 50/50 fixed point
    (without the warm-up, twice this rate stalls at a loss of 0.6 on some seeds)."""
    import math

    input_ids, labels = _answer_rows(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    # One thread: a model this small gains nothing from more, and on two busy cores two threads spin
    # (measured under load: 6-15 s on one thread, 230 s on two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for _ in range(steps):
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()


@torch.no_grad()
def answer_probabilities(model, tokenizer) -> torch.Tensor:
    """[prompts, 2]: each prompt's probability of its whole right and wrong response (format, answer, EOS)."""
    input_ids, labels = _answer_rows(tokenizer)
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (lp * (labels[:, 1:] != -100)).sum(1).exp().view(-1, 2)


def check_mixed_answers(model, tokenizer, min_prob: float = MIN_ANSWER_PROB) -> None:
    """Fail loudly where the tests' premise does not hold: a prompt whose right or wrong response has
    probability under `min_prob` can draw a uniform group, and the tests that read advantages turn trivial."""
    probs = answer_probabilities(model, tokenizer)
    low = [(f"{a}+{b}=?", round(float(r), 3), round(float(w), 3))
           for (a, b), (r, w) in zip(math_prompts(), probs.tolist()) if min(r, w) < min_prob]
    assert not low, (
        f"the warm-started tiny model gives these prompts a right or wrong response below {min_prob} "
        f"(prompt, p(right), p(wrong)): {low}. The tests need both near 0.5 so that every GRPO group holds "
        "both (see tests/support/nemo_cpu_standins.py, MIN_ANSWER_PROB): the warm start did not converge on "
        "this machine; raise warm_start_steps."
    )


def write_math_jsonl(path: Path, n: int | None = None, seed: int = 0) -> Path:
    """The first `n` of the 30 `math_prompts`, shuffled, each once (one group per prompt a run). The math
    environment's verifier grades the response's expression against the sum."""

    prompts = math_prompts()
    random.Random(seed).shuffle(prompts)
    if n is not None and n > len(prompts):
        raise ValueError(f"at most {len(prompts)} distinct prompts, not {n}")
    with path.open("w") as f:
        for a, b in prompts[:n]:
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


def token_logprobs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
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
        # train() calls these weights have seen: 0 for the base model, restored from a checkpoint
        saved_version = Path(weights_path or "/nonexistent") / VERSION_FILE
        self.version = json.loads(saved_version.read_text())["version"] if saved_version.exists() else 0
        # Policy's layout (lm_policy.py, lines 214-227) for one rank: async_grpo_train reads the DP size.
        self.sharding_annotations = NamedSharding(
            layout=[[[[0]]]], names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"]
        )
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
        lp = token_logprobs(self.model, data["input_ids"], self.temperature)
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
                    "logprobs": loss_input["next_token_logprobs"].detach().clone(), "policy_version": self.version,
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
        if not eval_mode:
            self.version += 1
        mb_metrics = defaultdict(list)  # lines 971-975, then lm_policy.py 787-791
        for m in all_mb_metrics:
            for k, v in m.items():
                mb_metrics[k].append(v)
        return {"loss": torch.tensor(losses), "grad_norm": grad_norm, "all_mb_metrics": dict(mb_metrics)}

    # -- checkpoints -----------------------------------------------------------------------------
    # Checkpoint saves follow the installed Policy's contract. Where it has `finalize_async_save` (NeMo-RL
    # main, #2828), saves are asynchronous as with `megatron_cfg.checkpoint.async_save`: save_checkpoint
    # returns once the state is staged (copied) and a writer thread writes the files; grpo's
    # begin_finalization waits for finalize_async_save before the tmp_step_N rename. On v0.7.0, whose grpo
    # renames right after the save, the save is synchronous.
    ASYNC_SAVES = hasattr(Policy, "finalize_async_save")

    def save_checkpoint(self, weights_path, optimizer_path=None, tokenizer_path=None, **_: Any) -> None:
        self.finalize_async_save()  # one save at a time, as NeMo-RL's workers do
        staged = ({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                  copy.deepcopy(self.optimizer.state_dict()) if optimizer_path else None)

        def write():
            self.model.save_pretrained(weights_path, state_dict=staged[0])
            (Path(weights_path) / VERSION_FILE).write_text(json.dumps({"version": self.version}))
            if optimizer_path:
                os.makedirs(optimizer_path, exist_ok=True)
                torch.save(staged[1], os.path.join(optimizer_path, "optim.pt"))

        if self.ASYNC_SAVES:
            self._writer = threading.Thread(target=write, name="async-checkpoint-writer")
            self._writer.weights_path = str(weights_path)
            self._writer.start()
        else:
            write()
        if tokenizer_path:
            self.tokenizer.save_pretrained(tokenizer_path)

    def finalize_async_save(self) -> None:
        writer, self._writer = getattr(self, "_writer", None), None
        if writer is not None:
            writer.join()
            ASYNC_SAVES_FINALIZED.append(writer.weights_path)

    # -- refit: the weights (and their version) go to the generator through _REFIT ---------------
    def stream_weights_via_ipc_zmq(self, buffer_size_bytes: int = 0, kv_scales=None) -> list:
        _REFIT["weights"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        _REFIT["version"] = self.version
        if os.environ.get(REFIT_FILE_ENV):
            # The real engine: its worker extension reads this file into vLLM's own `model.load_weights`
            # (tests/support/vllm_cpu_worker.py), where NeMo-RL's CUDA-IPC stream would end.
            save_file(_REFIT["weights"], os.environ[REFIT_FILE_ENV])
        return []

    def broadcast_weights_for_collective(self, kv_scales=None) -> list:
        # Non-colocated refit: v0.7.0 broadcasts over NCCL from the training ranks to the vLLM workers
        # (grpo.py refit_policy_generation, lines 1942-1948); here the weights are handed over on the
        # driver and the generator's update_weights_from_collective ships them to its actor.
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


# The generations the driver started in this process, for the test to shut down while Ray is up (upstream's
# __del__ shuts one down when it is collected, which after ray.shutdown() starts a local Ray to do it).
LIVE_GENERATIONS: list[Any] = []


class RecordingVllmGeneration(VllmGeneration):
    """NeMo-RL's own VllmGeneration (the real engine), unchanged, with a record of what it returned to the
    driver: per row, one segment (context, new tokens, their log-probs as NeMo-RL placed them) and the
    version of the policy weights refitted last (the stand-in policy's train() count). The record is kept
    in the process that calls `generate` (the driver when generation is colocated)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.version, self.refits = None, 0  # dummy weights until the first refit
        LIVE_GENERATIONS.append(self)

    def update_weights_via_ipc_zmq(self) -> list:
        futures = super().update_weights_via_ipc_zmq()
        self.version, self.refits = _REFIT["version"], self.refits + 1
        return futures

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        out = super().generate(data, greedy)
        for i in range(data.size):
            start = int(data["input_lengths"][i])
            end = start + int(out["generation_lengths"][i])
            SEGMENTS.append({"context": out["output_ids"][i, :start].tolist(),
                             "tokens": out["output_ids"][i, start:end].tolist(),
                             "logprobs": out["logprobs"][i, start:end].tolist(),
                             "version": self.version, "refits": self.refits})
            GENERATED_PROMPTS.append(SEGMENTS[-1]["context"])
        return out
