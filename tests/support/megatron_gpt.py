"""megatron-core's own GPTModel (its local, non-Transformer-Engine layer spec) holding a Qwen2's weights on
CPU, at tensor-parallel size 1, and the weight conversion between it and the HF names vLLM loads.

On the cluster, Megatron-Bridge builds the policy's GPTModel from the HF checkpoint (its Qwen2 bridge) and
converts it back to HF names for every refit. Bridge needs Transformer Engine to import (GPU image only),
so here the two conversions are the few lines below, checked against HF transformers' own Qwen2 forward
(tests/nemo_rl/test_vllm_engine.py): Megatron's fused QKV weight holds, per query group, that group's
query heads then its key head then its value head; its fused fc1 holds the gate projection then the up
projection. Everything else (the layers, RoPE, RMSNorm, the attention) is megatron-core's.

`MegatronQwen2` is a Ray actor: megatron-core on CPU needs the test shims (tests/support/nemo_rl_shim/
megatron_cpu.py), which patch torch process-wide, so the model lives in a process of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch

QKV, FC1 = "self_attention.linear_qkv", "mlp.linear_fc1"


def _layer_names(i: int) -> dict[str, str]:
    """Megatron's per-layer parameter names -> HF Qwen2's, where one maps to one."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    return {
        m + "input_layernorm.weight": h + "input_layernorm.weight",
        m + "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
        m + "self_attention.linear_proj.weight": h + "self_attn.o_proj.weight",
        m + "mlp.linear_fc2.weight": h + "mlp.down_proj.weight",
    }


GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _heads(hf_config) -> tuple[int, int, int]:
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    return heads // groups, groups, hf_config.hidden_size // heads  # query heads per group, groups, head dim


def hf_from_megatron(state: dict[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """A tensor-parallel-size-1 GPTModel's state dict in HF Qwen2's names (the refit's conversion)."""
    per_group, groups, head_dim = _heads(hf_config)
    hf = {GLOBAL_NAMES[name]: state[name] for name in GLOBAL_NAMES}
    for i in range(hf_config.num_hidden_layers):
        hf.update({h: state[m] for m, h in _layer_names(i).items()})
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            fused = state[f"{m}{QKV}.{kind}"].reshape(groups, per_group + 2, head_dim, -1)
            q, k, v = fused.split([per_group, 1, 1], dim=1)
            for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                hf[f"{h}self_attn.{name}.{kind}"] = part.reshape(-1, fused.shape[-1]).squeeze(-1)
        gate, up = state[f"{m}{FC1}.weight"].chunk(2, dim=0)
        hf[f"{h}mlp.gate_proj.weight"], hf[f"{h}mlp.up_proj.weight"] = gate, up
    return {name: tensor.detach().clone().contiguous() for name, tensor in hf.items()}


def megatron_from_hf(hf: dict[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """HF Qwen2's state dict in a tensor-parallel-size-1 GPTModel's names (the import Bridge does)."""
    _, groups, head_dim = _heads(hf_config)
    state = {name: hf[h] for name, h in GLOBAL_NAMES.items()}
    for i in range(hf_config.num_hidden_layers):
        state.update({m: hf[h] for m, h in _layer_names(i).items()})
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [hf[f"{h}self_attn.{name}.{kind}"] for name in ("q_proj", "k_proj", "v_proj")]
            q, k, v = (p.reshape(groups, -1, head_dim, *p.shape[1:]) for p in parts)
            state[f"{m}{QKV}.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *parts[0].shape[1:])
        state[f"{m}{FC1}.weight"] = torch.cat([hf[f"{h}mlp.gate_proj.weight"], hf[f"{h}mlp.up_proj.weight"]])
    return {name: tensor.detach().clone().contiguous() for name, tensor in state.items()}


def transformer_config(hf_config, **fields):
    """megatron-core's TransformerConfig of an HF Qwen2 config, in float32 with no fused kernels (CPU);
    `fields` set the rest (the parallel layout and precision a policy config asks for)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = {
        "num_layers": hf_config.num_hidden_layers, "hidden_size": hf_config.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size, "num_attention_heads": hf_config.num_attention_heads,
        "num_query_groups": hf_config.num_key_value_heads, "kv_channels": hf_config.hidden_size // hf_config.num_attention_heads,
        "normalization": "RMSNorm", "layernorm_epsilon": hf_config.rms_norm_eps, "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu, "add_bias_linear": False, "add_qkv_bias": True,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "params_dtype": torch.float32, "use_cpu_initialization": True,
        "bias_activation_fusion": False, "bias_dropout_fusion": False, "masked_softmax_fusion": False,
        "apply_rope_fusion": False, "persist_layer_norm": False, "gradient_accumulation_fusion": False,
    }
    return TransformerConfig(**{**shape, **fields})


def gpt_model_kwargs(hf_config) -> dict:
    """GPTModel's arguments after its TransformerConfig for an HF Qwen2: the local layer spec, vocabulary,
    RoPE, an untied output layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return {
        "transformer_layer_spec": get_gpt_layer_local_spec(normalization="RMSNorm"), "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings, "position_embedding_type": "rope",
        "rotary_base": rope_theta(hf_config), "share_embeddings_and_output_weights": False,
    }


@torch.no_grad()
def load_hf(model, hf: dict[str, torch.Tensor], hf_config) -> None:
    """Bridge's import: every GPTModel parameter from the HF names, none left over (strict)."""
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    model.load_state_dict({**megatron_from_hf(hf, hf_config), **extra}, strict=True)


def rope_theta(hf_config) -> float:
    """transformers 5 keeps it in `rope_parameters`; older releases as `rope_theta`."""
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


@ray.remote(num_cpus=0)
class MegatronQwen2:
    """megatron-core's GPTModel (local spec, TP 1 on a one-rank gloo group) with the Qwen2 in `model_dir`."""

    def __init__(self, model_dir: str, rendezvous: str):
        from tests.support.nemo_rl_shim import megatron_cpu

        megatron_cpu.install()
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from transformers import AutoConfig, Qwen2ForCausalLM

        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1234)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.model = GPTModel(transformer_config(self.hf_config), **gpt_model_kwargs(self.hf_config)).eval()
        self.load_hf(list(Qwen2ForCausalLM.from_pretrained(model_dir).state_dict().items()))

    def load_hf(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        load_hf(self.model, dict(weights), self.hf_config)

    def hf_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The refit's conversion of the current weights to HF names."""
        return list(hf_from_megatron(self.model.state_dict(), self.hf_config).items())

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """The model's logits over one causal sequence (float64)."""
        tokens = torch.tensor([list(ids)])
        with torch.no_grad():
            out = self.model(tokens, torch.arange(len(ids))[None], attention_mask=None)
        return out[0].double()

    def sgd_step(self, ids: Sequence[int], lr: float) -> float:
        """One plain SGD step on the next-token loss of `ids` through megatron-core's backward; the loss."""
        self.model.train()
        tokens = torch.tensor([list(ids)])
        logits = self.model(tokens[:, :-1], torch.arange(len(ids) - 1)[None], attention_mask=None)
        loss = torch.nn.functional.cross_entropy(logits[0].float(), tokens[0, 1:])
        self.model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.add_(parameter.grad, alpha=-lr)
        self.model.eval()
        return float(loss)
