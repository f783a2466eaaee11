"""Test fixtures for the context-parallel CPU rehearsal of the Megatron training path
(tests/nemo_rl/test_megatron_rehearsal.py): the tiny language model in its one-process form, its assets, and
the stand-in for vLLM's generation worker.

Kept free of Megatron imports: the generation workers (8 Ray actors) import only this module.

The tiny LM (`tiny_lm_logits`) is the model the CPU Megatron policy workers hold in Megatron's TP/CP
layout (tests/support/nemo_megatron_standins.py, `TinyParallelLM`); this module's one-process form is what the
generation workers sample from and what the tests compute references with:

    x = E[token] + P[position];  h = tanh(x);  y = h + tanh(h W1^T) W2^T;  logits = y Wout^T

Each token's next-token distribution depends on the token and its position only (no attention: ring
attention under context parallelism is a GPU kernel), which is enough for a warm start that answers the
prompts right about half of the time (`warm_start`): GRPO groups get mixed rewards, so advantages are not
zero and BAPO's searches have both signs to weigh.

`CPUVllmGenerationWorker` replaces NeMo-RL's `VllmGenerationWorker` (vLLM's engine needs GPUs): the real
`VllmGeneration` builds its `RayWorkerGroup` (tied TP groups, one model owner each), shards batches by DP
and merges the results; each owner samples token by token from the tiny LM and answers in the layout of
`VllmGenerationWorker.generate`. Refit (vLLM's CUDA-IPC/ZMQ weight stream) becomes a hand-over through a
named Ray actor (tests/support/refit_mailbox.py): the policy's rank 0 posts the full weights, every owner takes the newest.

Only this rehearsal keeps the stand-in: context-parallel attention is a Transformer Engine kernel, so its
policy holds the attention-free tiny LM, which the real engine cannot serve. Everywhere else (the fault and
async rehearsals, the driver e2e tests) NeMo-RL's own vLLM workers run the real engine
(tests/support/nemo_vllm_worker.py).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import load_file, save_file

from tests.support.nemo_faults import RECORD_DIR_ENV, reached
from tests.support.refit_mailbox import take_newer

WEIGHTS_FILE = "tiny_lm.safetensors"
SHAPE_FILE = "tiny_lm.json"
HIDDEN, FFN = 32, 64
# Plain concatenation: the character tokenizer has no chat template of its own.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# ---- the tiny LM, one-process form --------------------------------------------------------------------
# How Megatron's layout splits each weight over tensor-parallel ranks (dimension; None: replicated).
TP_SPLIT_DIM = {
    "embedding.weight": 0,  # VocabParallelEmbedding: by vocabulary
    "position_embedding.weight": None,
    "fc1.weight": 0,  # ColumnParallelLinear: by output
    "fc2.weight": 1,  # RowParallelLinear: by input
    "output_layer.weight": 0,  # ColumnParallelLinear over the vocabulary: vocab-parallel logits
}


def join_tp_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One-process weights from the tensor-parallel ranks' shards (in TP rank order)."""
    return {
        name: shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim=dim)
        for name, dim in TP_SPLIT_DIM.items()
    }


def init_tiny_lm(vocab: int, positions: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.3):
        return torch.randn(*shape, generator=g) * std

    return {
        "embedding.weight": normal(vocab, HIDDEN),
        "position_embedding.weight": normal(positions, HIDDEN),
        "fc1.weight": normal(FFN, HIDDEN),
        "fc2.weight": normal(HIDDEN, FFN),
        "output_layer.weight": normal(vocab, HIDDEN),
    }


def tiny_lm_logits(weights: dict[str, torch.Tensor], input_ids: torch.Tensor, positions: torch.Tensor):
    """[B, S, V] next-token logits of every position."""
    x = weights["embedding.weight"][input_ids] + weights["position_embedding.weight"][positions]
    h = torch.tanh(x)
    y = h + torch.tanh(h @ weights["fc1.weight"].T) @ weights["fc2.weight"].T
    return y @ weights["output_layer.weight"].T


def token_logprobs(weights, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] log-prob of each token given its prefix, 0 at position 0 (NeMo-RL's convention). Columns
    past the position table are padding (the driver widens batches for FP8 packing): they read its last
    row, as the Megatron-layout model does."""
    table = weights["position_embedding.weight"].shape[0]
    positions = torch.arange(input_ids.shape[1]).clamp(max=table - 1).expand_as(input_ids)
    logits = tiny_lm_logits(weights, input_ids, positions)
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


# ---- assets -------------------------------------------------------------------------------------------
# Prompts "a+b=?" whose answers are 2 or 3; the warm-started model answers with spaces, then 2 or 3 (each
# half of the time, whatever the prompt), then EOS: "  3<eos>". The math verifier reads the last number.
ANSWER_PROMPTS = [(a, b) for a in range(4) for b in range(4) if a + b in (2, 3)]


def write_answer_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.choice(ANSWER_PROMPTS)
            f.write(json.dumps({"input": f"{a}+{b}=?", "output": str(a + b)}) + "\n")
    return path


def _sample_response(rng: random.Random, tok: dict[str, int], prompt_len: int) -> list[int]:
    """The warm start's target: 0-4 spaces, then '2' or '3' (half each), then EOS."""
    out, pos = [], prompt_len
    while True:
        space_p = 0.5 if not out else (0.4 if pos < prompt_len + 4 else 0.0)
        if rng.random() < space_p:
            out.append(tok[" "])
            pos += 1
            continue
        return out + [tok[rng.choice("23")], tok["eos"]]


def warm_start(weights, tokenizer, steps: int = 300, seed: int = 0, batch_size: int = 64) -> None:
    """Supervised steps on the target above (loss on the response tokens only), in place."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = {c: tokenizer.convert_tokens_to_ids(c) for c in " 23"} | {"eos": tokenizer.eos_token_id}
    params = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2)
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            a, b = rng.choice(ANSWER_PROMPTS)
            prompt = tokenizer.encode(f"{a}+{b}=?", add_special_tokens=False)
            rows.append((prompt, _sample_response(rng, tok, len(prompt))))
        width = max(len(p) + len(r) for p, r in rows)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        target_mask = torch.zeros(batch_size, width)
        for i, (p, r) in enumerate(rows):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            target_mask[i, len(p) : len(p) + len(r)] = 1
        lp = token_logprobs(params, ids)
        loss = -(lp * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        for k in weights:
            weights[k].copy_(params[k])


def write_rehearsal_model(directory: Path, positions: int, seed: int = 0) -> Path:
    """A model directory NeMo-RL can point at: the tokenizer (HF files), a config.json (read by NeMo-RL's
    FLOPs tracker and `bapo-nemo check`; the architecture is the tiny LM's, described as the Qwen2 family
    the shipped models belong to) and the warm-started weights in one-process form."""
    from transformers import Qwen2Config

    from bapo_nemo.embedded.model.tokenizer import build_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(directory)
    vocab = len(tokenizer)
    Qwen2Config(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=positions,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(directory)
    torch.set_num_threads(1)  # the same float reductions on any machine
    weights = init_tiny_lm(vocab, positions, seed)
    warm_start(weights, tokenizer, seed=seed)
    save_file(weights, str(directory / WEIGHTS_FILE))
    (directory / SHAPE_FILE).write_text(json.dumps({"vocab": vocab, "positions": positions}))
    return directory


def load_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / WEIGHTS_FILE))


# ---- vLLM's place -------------------------------------------------------------------------------------
class TinyLMGenerationWorker:
    """What both generation stand-ins share: each tied group's model owner (the worker given
    `bundle_indices`, as in `BaseVllmGenerationWorker._init_config`) holds the tiny LM and samples from it
    one token at a time; refit takes the newest weights from the mailbox; what was sampled is recorded
    under RECORD_DIR_ENV."""

    @staticmethod
    def configure_worker(num_gpus, bundle_indices=None, num_gpus_per_node=None):
        # As VllmGenerationWorker.configure_worker: the owner learns its bundles and a seed from them
        # (num_gpus_per_node, which main passes, only places vLLM's ports: none here).
        init_kwargs: dict[str, Any] = {}
        if bundle_indices is not None:
            node_idx, local = bundle_indices
            init_kwargs["bundle_indices"] = local
            init_kwargs["seed"] = node_idx * 1024 + local[0] // len(local)
        return {"num_gpus": num_gpus}, {}, init_kwargs, {}

    def __init__(self, config, bundle_indices=None, fraction_of_gpus=1.0, seed=None, **_: Any):
        torch.set_num_threads(1)
        self.cfg = config
        self.is_model_owner = bundle_indices is not None
        self.weights, self.version, self.seed = None, 0, seed
        self.policy_steps = 0  # optimizer steps the weights have seen (refits say so)
        if self.is_model_owner:
            self.weights = load_weights(config["model_name"])
            self.generator = torch.Generator().manual_seed(int(seed))

    def is_alive(self) -> bool:
        return True

    def report_device_id(self) -> list[str]:
        return [f"CPU-standin-{self.seed}"]

    def response_budget(self, prompt_length: int) -> int:
        """New tokens a request may take (VllmGenerationWorker: max_new_tokens, within max_model_len)."""
        return max(0, min(int(self.cfg["max_new_tokens"]), int(self.cfg["vllm_cfg"]["max_model_len"]) - prompt_length))

    @torch.no_grad()
    def sample_next(self, sequence: list[int], greedy: bool) -> tuple[int, float]:
        """One decode step: the next token after `sequence` and its log-prob (at the configured temperature)."""
        temperature = float(self.cfg.get("temperature", 1.0))
        ids = torch.tensor([sequence])
        logits = tiny_lm_logits(self.weights, ids, torch.arange(len(sequence))[None])[0, -1] / temperature
        probs = torch.softmax(logits.double(), -1)
        token = int(probs.argmax()) if greedy else int(torch.multinomial(probs, 1, generator=self.generator))
        return token, float(torch.log(probs[token]))

    def check_refit_names(self, state_dict_info: dict[str, Any]) -> None:
        if self.is_model_owner:
            missing = set(self.weights) ^ set(state_dict_info)
            if missing:
                raise ValueError(f"refit names differ from the generation model's: {sorted(missing)}")

    def install(self, taken: tuple[int, dict[str, torch.Tensor], int]) -> bool:
        """Weights taken from the mailbox (`take_newer`) become the ones sampled from."""
        self.version, self.weights, self.policy_steps = taken
        return True

    def record(self, rows: list[dict[str, Any]], name: str) -> None:
        """Append what was sampled to RECORD_DIR_ENV/generation/NAME.jsonl (when the variable is set)."""
        directory = os.environ.get(RECORD_DIR_ENV)
        if directory and rows:
            path = Path(directory) / "generation" / f"{name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")


class CPUVllmGenerationWorkerImpl(TinyLMGenerationWorker):
    """`VllmGenerationWorker`'s methods for the synchronous engine, with the tiny LM sampling in place of
    vLLM's engine."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sampled: list[dict[str, Any]] = []

    def post_init(self):
        return None

    @torch.no_grad()
    def generate(self, data, greedy: bool = False):
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
        from nemo_rl.models.generation.interfaces import verify_right_padding

        pad = int(self.cfg["_pad_token_id"])
        verify_right_padding(data, pad_value=pad)
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        stops = set(self.cfg.get("stop_token_ids") or [])
        generated, logprobs = [], []
        for i in range(input_ids.shape[0]):
            prompt = input_ids[i, : int(input_lengths[i])].tolist()
            budget = self.response_budget(len(prompt))
            seq, lps = list(prompt), []
            while len(seq) - len(prompt) < budget:
                token, logprob = self.sample_next(seq, greedy)
                seq.append(token)
                lps.append(logprob)
                if token in stops:
                    break
            generated.append(seq[len(prompt) :])
            logprobs.append(lps)
            self.sampled.append({"context": prompt, "tokens": seq[len(prompt) :], "logprobs": lps,
                                 "policy_steps": self.policy_steps})
            reached("generation.generate", self.seed)  # tests/support/nemo_faults.py: mid-batch
        # VllmGenerationWorker.generate's layout: input padding kept, responses after each prompt.
        max_length = max((len(g) for g in generated), default=0)
        total = input_ids.shape[1] + max_length
        output_ids = torch.full((len(generated), total), pad, dtype=input_ids.dtype)
        full_logprobs = torch.zeros((len(generated), total), dtype=torch.float32)
        for i, (g, lp) in enumerate(zip(generated, logprobs)):
            n = int(input_lengths[i])
            output_ids[i, :n] = input_ids[i, :n]
            output_ids[i, n : n + len(g)] = torch.tensor(g, dtype=input_ids.dtype)
            full_logprobs[i, n : n + len(g)] = torch.tensor(lp)
        lengths = torch.tensor([len(g) for g in generated], dtype=torch.long)
        truncated = [len(g) > 0 and g[-1] not in stops for g in generated]
        self._flush_record()
        return BatchedDataDict(
            {
                "output_ids": output_ids,
                "logprobs": full_logprobs,
                "generation_lengths": lengths,
                "unpadded_sequence_lengths": input_lengths + lengths,
                "truncated": torch.tensor(truncated, dtype=torch.bool),
            }
        )

    def _flush_record(self) -> None:
        self.record(self.sampled, f"owner{self.seed}")
        self.sampled = []

    # -- refit: the newest weights the policy posted ------------------------------------------------
    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        self.check_refit_names(state_dict_info)

    def update_weights_via_ipc_zmq(self) -> bool:
        if not self.is_model_owner:
            return True
        return self.install(take_newer(self.version))

    def update_weights_from_collective(self) -> bool:
        return self.update_weights_via_ipc_zmq()

    # -- engine life cycle: nothing to free on CPU ---------------------------------------------------
    def sleep(self):
        return None

    def wake_up(self, **kwargs):
        return None

    def reset_prefix_cache(self):
        return None

    def _get_raw_spec_counters(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> bool:
        self._flush_record()
        return True


@ray.remote
class CPUVllmGenerationWorker(CPUVllmGenerationWorkerImpl):
    """The Ray actor VllmGeneration starts for the synchronous engine."""
