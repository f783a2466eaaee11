"""The per-GPU memory model, term by term, against hand-computed numbers for a tiny model."""

from __future__ import annotations

import pytest

from bapo_nemo.plan.rules.memory import (
    FRAGMENTATION,
    GB,
    RUNTIME_RESERVE_BYTES,
    GenerationSetup,
    Parallelism,
    TrainingSetup,
    activation_bytes,
    estimate,
    gradient_bytes,
    layer_activation_bytes_per_token,
    logits_bytes,
    optimizer_bytes,
    stage_parameters,
    weight_bytes,
)
from bapo_nemo.plan.rules.models import BUILTIN, ModelShape

# h=8, 4 layers, 2 heads x head_dim 4 (q=8), 1 KV head (kv=4), MLP 16, vocab 10, untied.
TINY = ModelShape(
    "tiny",
    hidden_size=8,
    num_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
    tie_word_embeddings=False,
)
# one layer: h*q + 2*h*kv + q*h + 3*h*f + 2h = 64 + 64 + 64 + 384 + 16 = 592


def _train(**over):
    base = {
        "micro_batch_tokens": 64,
        "micro_batches_per_step": 5,
        "activation_checkpointing": False,
        "fp8": False,
        "fp8_param": False,
        "grad_reduce_in_fp32": False,
        "distributed_optimizer": True,
        "optimizer_cpu_offload": False,
    }
    base.update(over)
    return TrainingSetup(**base)


def test_parameter_counts():
    assert TINY.num_parameters() == 4 * 592 + 2 * 80 + 8  # layers + embedding and output layer + final norm
    # published sizes: 7.62B and 32.8B
    assert BUILTIN["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"].num_parameters() / 1e9 == pytest.approx(
        7.62, abs=0.01
    )
    assert BUILTIN["deepseek-ai/DeepSeek-R1-Distill-Qwen-32B"].num_parameters() / 1e9 == pytest.approx(
        32.76, abs=0.01
    )


def test_stage_parameters():
    # tp 2, pp 2: 2 layers + one vocab block = (1184 + 80) / 2 = 632
    assert stage_parameters(TINY, Parallelism(tp=2, pp=2, cp=1, dp=1, sequence_parallel=False)) == 632
    # tp 1, pp 1: all 4 layers + embedding + output = 2368 + 160 = 2528
    assert stage_parameters(TINY, Parallelism(tp=1, pp=1, cp=1, dp=1, sequence_parallel=False)) == 2528


def test_weights_gradients_optimizer():
    p = 632.0
    assert weight_bytes(p, _train()) == 1264  # bf16
    assert weight_bytes(p, _train(fp8=True)) == 2528  # + FP8 cast and transpose copies
    assert weight_bytes(p, _train(fp8=True, fp8_param=True)) == 1264
    assert gradient_bytes(p, _train()) == 1264
    assert gradient_bytes(p, _train(grad_reduce_in_fp32=True)) == 2528
    par = Parallelism(tp=2, pp=2, cp=2, dp=3, sequence_parallel=True)
    assert optimizer_bytes(p, par, _train()) == 12 * 632 / 6  # sharded over dp * cp = 6 -> 1264
    assert optimizer_bytes(p, par, _train(distributed_optimizer=False)) == 7584
    assert optimizer_bytes(p, par, _train(optimizer_cpu_offload=True)) == 0


def test_activations_and_logits():
    # per token per layer: 2 * (5*8 + 2*8 + 2*4 + 3*16) = 2 * 112 = 224 bytes
    assert layer_activation_bytes_per_token(TINY) == 224
    sp = Parallelism(tp=2, pp=2, cp=2, dp=1, sequence_parallel=True)
    # 64 tokens / cp 2 / tp 2 = 16 per GPU; 2 layers per stage; min(pp 2, 5 micro-batches) = 2 in flight
    assert activation_bytes(TINY, sp, _train()) == 2 * 224 * 16 * 2  # 14336
    # full recompute: layer inputs 2 layers * 2h=16 B * 16 tokens * 2 in flight = 1024, + one layer 224*16
    assert activation_bytes(TINY, sp, _train(activation_checkpointing=True)) == 1024 + 3584
    no_sp = Parallelism(tp=2, pp=2, cp=2, dp=1, sequence_parallel=False)
    assert activation_bytes(TINY, no_sp, _train()) == 2 * 224 * 32 * 2  # not divided by tp
    # logits: 3 fp32 copies * (vocab 10 / tp 2) * (64 tokens / cp 2) = 12 * 5 * 32
    assert logits_bytes(TINY, sp, _train()) == 1920


def test_estimate_phases_and_verdict():
    par = Parallelism(tp=2, pp=2, cp=2, dp=3, sequence_parallel=True)
    est = estimate(TINY, par, _train(), GenerationSetup(colocated=True, gpu_memory_utilization=0.5))
    terms = 1264 + 1264 + 1264 + 14336 + 1920
    assert sum(est.terms.values()) == terms
    assert est.training_peak == pytest.approx(terms * (1 + FRAGMENTATION) + RUNTIME_RESERVE_BYTES)
    # refit: training weights 2 * 632 next to vLLM's 0.5 * 80 GB
    assert est.generation_peak == pytest.approx(1264 + 40 * GB + RUNTIME_RESERVE_BYTES)
    assert est.peak == est.generation_peak and est.fits
    assert est.margin == pytest.approx(80 * GB - est.generation_peak)
    apart = estimate(TINY, par, _train(), GenerationSetup(colocated=False, gpu_memory_utilization=0.9))
    assert apart.generation_peak == 0 and apart.peak == apart.training_peak
    too_much = estimate(TINY, par, _train(), GenerationSetup(colocated=True, gpu_memory_utilization=0.99))
    assert not too_much.fits  # 79.2 GB + 4 GB reserve > 80 GB
