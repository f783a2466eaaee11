"""How far FP8-trained log-probs sit from a bf16 reload, and from wrong weights, side by side on CPU.

The export's parity check compares log-probs recorded at training time (NeMo-RL's `get_logprobs`, which
runs the FP8 forward when `fp8_cfg.enabled`) with the exported model reloaded in bf16. This measures, on
tiny Qwen2 models (3 seeds, bf16): the per-token |dlogp| between the blockwise-FP8 forward
(bapo_nemo/export/fp8_blockwise.py) and the plain bf16 forward of the same weights, and between it and a
model with other weights (what a broken conversion looks like). Prints mean / p99 / max for both and
their ratio. Usage: python bench/fp8_parity.py [--hidden 256] [--layers 2] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.export.fp8_blockwise import blockwise_fp8_linears
from bapo_nemo.export.parity import FP8_TRAINED_MEAN_TOLERANCE, token_logprobs


def diffs(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return sorted(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def describe(d: list[float]) -> str:
    return f"mean {statistics.mean(d):.4f}  p99 {d[int(0.99 * (len(d) - 1))]:.4f}  max {d[-1]:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=2)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(args.vocab, (40,), generator=gen).tolist() for _ in range(6)]
    print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, bf16; {len(sequences)} x 40 tokens")
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
        bf16 = token_logprobs(model, sequences)
        with blockwise_fp8_linears(model):
            fp8 = token_logprobs(model, sequences)
        torch.manual_seed(1000 + seed)
        wrong = token_logprobs(Qwen2ForCausalLM(config).to(torch.bfloat16).eval(), sequences)
        ok, bad = diffs(fp8, bf16), diffs(fp8, wrong)
        print(f"seed {seed}: FP8 vs bf16 reload: {describe(ok)}")
        print(f"        FP8 vs wrong weights: {describe(bad)}   (mean ratio {statistics.mean(bad) / statistics.mean(ok):.1f}x)")
    print(f"export criterion for FP8-trained checkpoints: mean |dlogp| <= {FP8_TRAINED_MEAN_TOLERANCE}")


if __name__ == "__main__":
    main()
