"""Held-out evaluation: k samples per prompt at the training temperature, reported as avg@k (mean
accuracy over all samples) and pass@k (share of prompts with at least one correct sample)."""

from __future__ import annotations

import torch

from bapo_nemo.embedded.generation import sample_continuations
from bapo_nemo.embedded.tasks import Task, reward


def encode_prompt(tokenizer, question: str) -> list[int]:
    return [tokenizer.bos_token_id] + tokenizer.encode(question, add_special_tokens=False)


def decode_response(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    tasks: list[Task],
    k: int,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
    batch_size: int = 256,
) -> dict[str, float]:
    """avg@k, pass@k and mean response length over `tasks`. The sampling seed is fixed, so successive
    evaluations of a changing policy share their random numbers (less noise between points)."""
    generator = torch.Generator().manual_seed(seed)
    contexts = [encode_prompt(tokenizer, t.question) for t in tasks for _ in range(k)]
    outs = []
    for start in range(0, len(contexts), batch_size):
        outs += sample_continuations(
            model,
            contexts[start : start + batch_size],
            max_new_tokens,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            generator,
            temperature,
        )
    correct = [
        reward(decode_response(tokenizer, o.token_ids), tasks[i // k]) if o.finished else 0.0
        for i, o in enumerate(outs)
    ]
    per_prompt = [correct[i * k : (i + 1) * k] for i in range(len(tasks))]
    return {
        "eval/avg_at_k": sum(correct) / len(correct),
        "eval/pass_at_k": sum(any(c) for c in per_prompt) / len(tasks),
        "eval/response_length": sum(len(o.token_ids) for o in outs) / len(outs),
    }
