"""Test fixtures: CPU stand-ins for NeMo-RL v0.7.0's two GPU worker groups.

`python -m bapo_nemo.train` runs NeMo-RL's real `setup()` and `grpo_train`/`async_grpo_train` on CPU in
the tests; only what cannot run here is replaced, at that boundary and nowhere else:
- `nemo_rl.algorithms.grpo.Policy` (DTensor/Megatron training workers on GPUs) -> `CPUPolicyStandIn`,
- `nemo_rl.algorithms.grpo.VllmGeneration` (vLLM workers on GPUs) -> `CPUGenerationStandIn`.
Both hold a tiny Qwen2. The policy lives in the driver process; the generator too when generation is
colocated, and in a Ray actor of its own when it is not (async GRPO): there, as with vLLM's workers, the
driver's object and the copy pickled into NeMo-RL's `AsyncTrajectoryCollector` actor drive the same
sampler, and a refit reaches the one both use. Everything else (Ray and its placement groups, data
processing, the math environment's Ray actors, the advantage estimator, the Logger writing to MLflow,
the CheckpointManager, the async loop's collector and replay buffer, the loss) is NeMo-RL's own code.

Weight versions: the policy counts its train() calls (saved with its weights, so a resumed policy
continues the count) and every refit hands that count to the generator with the weights, so each
sampled segment records the policy version that produced it (the partial-rollout hook's numbering).

The stand-in policy's `train()` follows v0.7.0's DTensor worker (`nemo_rl/models/policy/workers/
dtensor_policy_worker.py`, `DTensorPolicyWorker.train`, lines 579-990) with one data-parallel rank:
the same global-batch split, `global_valid_seqs`/`global_valid_toks` over the global batch, NeMo-RL's
own `prepare_loss_input` for the loss's inputs, the same per-micro-batch metric scaling and the same
result dict; `Policy.train` (`nemo_rl/models/policy/lm_policy.py`, lines 702-793) then aggregates
`all_mb_metrics` as lists, which this class returns directly.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import random
import threading
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams
from nemo_rl.algorithms.loss.interfaces import LossInputType
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.named_sharding import NamedSharding
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.interfaces import ColocatablePolicyInterface
from nemo_rl.models.policy.lm_policy import Policy
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.embedded.model.tokenizer import build_tokenizer

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
# Every sampled segment: its context, new tokens, their log-probs, and the policy version of the weights
# that sampled it (train() calls those weights had seen). A generator in its own actor hands its record
# over when it shuts down.
SEGMENTS: list[dict[str, Any]] = []
# The policy stand-in's version, saved beside its weights in every checkpoint.
VERSION_FILE = "standin_policy_version.json"
# Called at the start of every train(), e.g. to deliver a signal "during step N".
ON_TRAIN: list[Any] = []


# The tests' premise, by construction: a GRPO group of G samples of the warm-started model holds a right
# AND a wrong answer, so its advantages are non-zero and BAPO's bound search has both signs to weigh, on
# any machine (the async test samples with these weights only; a sync run's first step does).
# - The tiny model is taught, for each of the 30 prompts, two answers at 50% each: the sum (rewarded) and
#   the sum + 1 (not). Full-batch training on all 60 rows converges to that fixed point whatever the CPU's
#   float reductions (measured: every prompt's two responses within [0.47, 0.51], see _warm_start).
#   The former warm start (380 steps toward the right answer only) depended on them: with one thread
#   instead of two, the same seed gave 96% right answers instead of 54%, and most groups came out uniform.
# - TinySampler draws a prompt's G samples as one stratified set (see its docstring): a response of
#   probability at least 1/G always receives one of them.
# So every group is mixed while each prompt's right and wrong response have probability >= 1/G = 0.25
# (G = 4 in the tests); check_mixed_answers asserts >= MIN_ANSWER_PROB after every warm start.
MIN_ANSWER_PROB = 0.35


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
        f"(prompt, p(right), p(wrong)): {low}. The tests need both near 0.5 so that every GRPO group of 4 "
        "stratified samples holds both (see tests/support/nemo_cpu_standins.py, MIN_ANSWER_PROB): the warm start "
        "did not converge on this machine; raise warm_start_steps."
    )


def write_math_jsonl(path: Path, n: int | None = None, seed: int = 0) -> Path:
    """The first `n` of the 30 `math_prompts`, shuffled, each once: a prompt then has one group a run, so
    its samples are the first G draws of that prompt (TinySampler's stratified set). The math
    environment's verifier grades the response's expression against the sum."""
    import random

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


class TinySampler:
    """The sampling itself: ancestral sampling from a tiny Qwen2, one token at a time, recording every
    segment it produces. Runs in the driver (colocated) or inside `_SamplerActor` (not colocated).

    Each draw is exact ancestral sampling from the model, and the draws from one context are stratified,
    so that a GRPO group cannot come out uniform by chance. A draw decodes one number u in [0, 1): at each
    position it takes the token whose interval of the cumulative distribution (tokens in id order) holds u,
    then rescales u into that interval: when u is uniform, every token is drawn with the model's
    probability (inverse-CDF sampling), and u picks the response at quantile u of the model's distribution
    over responses ordered token by token. The n-th draw from one context (prompt plus response so far,
    counted over this sampler's life) takes u = offset + vdc(n) mod 1, where vdc is the base-2 van der
    Corput sequence (0, 1/2, 1/4, 3/4, 1/8, ...) and the offset is uniform, fixed by (seed, context). Each
    draw is therefore uniform on its own, and the first 2^k draws from a context are 2^k points 2^-k apart
    on the circle: any set of responses of probability >= 2^-k whose quantiles form an interval (e.g. all
    responses starting "3+2=5<eos>") receives at least one of them. vLLM draws a group's samples
    independently; the tests need only each sample's law (the behaviour log-probs) to be the model's.
    Samplers with the same seed draw the same quantiles: a group split over several must give each its
    own seed (it is then stratified within each sampler only).
    Once a draw's u has lost float64 resolution (a response less likely than ~1e-10), it continues with
    fresh uniforms of its own."""

    def __init__(self, model_name: str, seed: int = 1234):
        torch.set_num_threads(1)  # CI's few cores are shared with the trainer and Ray's actors
        self.model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32).eval()
        self.seed = seed
        self.version = 0
        self.refits = 0  # weight loads since start: vLLM trains from dummy weights until the first one
        self.segments: list[dict[str, Any]] = []
        self.draws: dict[tuple[int, ...], int] = defaultdict(int)  # draws taken so far, per context
        self._draws_lock = threading.Lock()  # a worker may serve concurrent requests

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> bool:
        self.model.load_state_dict(weights)
        self.version = version
        self.refits += 1
        return True

    @torch.no_grad()
    def generate(
        self, cfg: dict, data: BatchedDataDict, greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict:
        """`seed`: the offsets' seed for this call (default: the sampler's). Rows may arrive in any order
        and in any grouping (async GRPO sends one row per request from several collector threads): a
        group's draws are the same set whenever its G rows are the first G draws of their context."""
        seed = self.seed if seed is None else seed
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        max_new = int(cfg["max_new_tokens"])
        pad, stops = int(cfg["_pad_token_id"]), set(cfg.get("stop_token_ids") or [])
        temperature = float(cfg.get("temperature", 1.0))
        rows, lps, gen_lens = [], [], []
        for i in range(input_ids.shape[0]):
            seq = input_ids[i, : int(input_lengths[i])].tolist()
            n_in, seq_lp = len(seq), []
            draw = _Quantile(seed, tuple(seq), self._next_draw(tuple(seq)))
            while len(seq) - n_in < max_new:
                logits = self.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                probs = torch.softmax(logits / temperature, dim=-1)
                tok = int(probs.argmax()) if greedy else draw.token(probs)
                seq.append(tok)
                seq_lp.append(float(torch.log(probs[tok])))
                if tok in stops:
                    break
            self.segments.append({"context": seq[:n_in], "tokens": seq[n_in:], "logprobs": seq_lp,
                                  "version": self.version, "refits": self.refits})
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

    def _next_draw(self, context: tuple[int, ...]) -> int:
        with self._draws_lock:
            n = self.draws[context]
            self.draws[context] = n + 1
        return n

    def take_segments(self) -> list[dict[str, Any]]:
        taken, self.segments = self.segments, []
        return taken


def van_der_corput(n: int) -> float:
    """n's binary digits mirrored after the point: 0, 1/2, 1/4, 3/4, 1/8, 5/8, 3/8, 7/8, ..."""
    x, scale = 0.0, 0.5
    while n:
        x += scale * (n & 1)
        n, scale = n >> 1, scale / 2
    return x


class _Quantile:
    """One draw of TinySampler: the number u it decodes, token by token (see TinySampler)."""

    RESOLUTION = 1e-6  # u's float64 error (2^-53, grown by 1/p at every token) above which u is spent

    def __init__(self, seed: int, context: tuple[int, ...], n: int):
        key = f"{seed}/{context}"
        offset = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64
        self.u = (offset + van_der_corput(n)) % 1.0
        self.error = 2.0**-53
        self.fresh = random.Random(f"{key}/{n}")

    def token(self, probs: torch.Tensor) -> int:
        if self.error > self.RESOLUTION:
            self.u, self.error = self.fresh.random(), 2.0**-53
        p = probs.double()
        cdf = torch.cumsum(p, 0) / p.sum()
        tok = int(torch.searchsorted(cdf, torch.tensor([self.u], dtype=torch.float64), right=True)[0])
        tok = min(tok, int(p.nonzero().max()))  # a u rounded up to the top edge: the last possible token
        low = float(cdf[tok - 1]) if tok else 0.0
        width = float(cdf[tok]) - low
        self.u = min(max((self.u - low) / width, 0.0), 1.0 - 2.0**-53)
        self.error /= width
        return tok


# No logical CPU: the head's few CPUs go to NeMo-RL's own actors (environment, collector, buffer).
_SamplerActor = ray.remote(num_cpus=0)(TinySampler)
RAY_TIMEOUT_S = 300


class CPUGenerationStandIn(GenerationInterface):
    """vLLM's place: samples from its own copy of the tiny model; refit copies the policy's weights.

    Colocated generation samples in the driver process; non-colocated generation (async GRPO) samples in
    a Ray actor, and this object is a handle on it that pickles into NeMo-RL's trajectory collector
    (v0.7.0 passes `policy_generation` to `AsyncTrajectoryCollector.remote(...)`, grpo.py line 3523).
    `generate_async` is the async-engine API run_async_multi_turn_rollout calls (rollouts.py, lines
    356-372): it yields (index, one-row output) as each row finishes."""

    def __init__(self, cluster=None, config=None, **_: Any):
        self.cfg = config
        self.colocated = bool((config.get("colocated") or {}).get("enabled", True))
        if self.colocated:
            self.sampler, self.actor = TinySampler(config["model_name"]), None
        else:
            self.sampler, self.actor = None, _SamplerActor.remote(config["model_name"])

    def __getstate__(self) -> dict:
        if self.actor is None:
            raise TypeError("a colocated CPU generator lives in the driver process and is not sent to actors")
        return {"cfg": self.cfg, "colocated": False, "sampler": None, "actor": self.actor}

    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        if self.sampler is not None:
            out = self.sampler.generate(self.cfg, data, greedy)
            self._record(self.sampler.take_segments())
            return out
        return ray.get(self.actor.generate.remote(self.cfg, data, greedy), timeout=RAY_TIMEOUT_S)

    async def generate_async(self, data: BatchedDataDict, greedy: bool = False):
        if self.actor is None:
            raise NotImplementedError("the async engine is modelled for non-colocated generation only")
        # One request per row, as vLLM's async engine streams them; the sampler counts the draws of each
        # prompt, so a group's G rows are its first G draws in whatever order the collector's threads send them.
        refs = [self.actor.generate.remote(self.cfg, data.slice(i, i + 1), greedy) for i in range(data.size)]
        pending = {asyncio.ensure_future(self._await(i, ref)) for i, ref in enumerate(refs)}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                yield task.result()

    @staticmethod
    async def _await(index: int, ref) -> tuple[int, BatchedDataDict]:
        return index, await asyncio.wait_for(ref, timeout=RAY_TIMEOUT_S)

    @staticmethod
    def _record(segments: list[dict[str, Any]]) -> None:
        SEGMENTS.extend(segments)
        GENERATED_PROMPTS.extend(list(s["context"]) for s in segments)

    def update_weights_via_ipc_zmq(self) -> list:
        if self.sampler is not None:
            self.sampler.load_weights(_REFIT["weights"], _REFIT["version"])
            return [ray.put(True)]
        return [self.actor.load_weights.remote(_REFIT["weights"], _REFIT["version"])]

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
        if self.actor is not None:  # the actor's record of what it sampled, then the actor itself
            self._record(ray.get(self.actor.take_segments.remote(), timeout=RAY_TIMEOUT_S))
            ray.kill(self.actor)
            self.actor = None
        return True
