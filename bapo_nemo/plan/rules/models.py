"""Model shapes the planner needs, from a local HF `config.json` or a small built-in table.

No hub access at run time: the table holds the models we ship configs for (and the published NeMo-RL
recipe we compare against), copied from their `config.json` on the Hugging Face hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Dense decoder (Qwen2/Qwen3/Llama): embeddings, attention with biases ignored, SwiGLU MLP, norms."""
        h = self.hidden_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h


BUILTIN: dict[str, ModelShape] = {
    # Qwen2.5-Math-7B architecture
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": ModelShape(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", 3584, 28, 28, 4, 128, 18944, 152064, False
    ),
    # Qwen2.5-32B architecture
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B": ModelShape(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 5120, 64, 40, 8, 128, 27648, 152064, False
    ),
    # NeMo-RL's published recipe grpo-qwen3-32b-4n8g (q_dim 8192 != hidden 5120)
    "Qwen/Qwen3-32B": ModelShape("Qwen/Qwen3-32B", 5120, 64, 64, 8, 128, 25600, 151936, False),
}


class UnknownModelError(LookupError):
    pass


def from_hf_config(path: str | Path, name: str | None = None) -> ModelShape:
    """Read a local HF `config.json` (file or directory holding it)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    cfg = json.loads(file.read_text())
    heads = cfg["num_attention_heads"]
    return ModelShape(
        name=name or str(path),
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def resolve_model(model_name: str, hf_config: str | None = None) -> ModelShape:
    """--hf-config wins; then a local model directory; then the built-in table."""
    if hf_config:
        return from_hf_config(hf_config, name=model_name)
    local = Path(model_name)
    if local.is_dir() and (local / "config.json").is_file():
        return from_hf_config(local, name=model_name)
    if model_name in BUILTIN:
        return BUILTIN[model_name]
    raise UnknownModelError(
        f"policy.model_name={model_name!r}: no local config.json and not in the built-in table "
        f"({', '.join(BUILTIN)}); pass --hf-config /path/to/config.json"
    )
