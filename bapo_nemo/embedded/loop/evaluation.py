"""Held-out evaluation: k samples per prompt at the training temperature, reported as avg@k (mean
accuracy over all samples) and pass@k (share of prompts with at least one correct sample), with the sample
behind them (prompts, samples per prompt) and avg@k's standard error over prompts."""

from __future__ import annotations

import math

import torch

from bapo_nemo.embedded.data.tasks import Task, reward
from bapo_nemo.embedded.loop.generation import sample_continuations


def encode_prompt(tokenizer, question: str) -> list[int]:
    """The prompt's token ids: the question as a user turn of the tokenizer's chat template (with the
    assistant turn opened) when it has one; otherwise BOS (if any) and the question's tokens."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer.encode(question, add_special_tokens=False)


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
    encode=None,
    score=None,
) -> dict[str, float]:
    """avg@k, pass@k and mean response length over `tasks`. The sampling seed is fixed, so successive
    evaluations of a changing policy share their random numbers (less noise between points).

    encode(task) -> prompt ids and score(response text, task) -> reward default to the bundled tasks'
    (`encode_prompt`, the arithmetic `reward`)."""
    encode = encode or (lambda t: encode_prompt(tokenizer, t.question))
    score = score or reward
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    contexts = [encode(t) for t in tasks for _ in range(k)]
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
        score(decode_response(tokenizer, o.token_ids), tasks[i // k]) if o.finished else 0.0
        for i, o in enumerate(outs)
    ]
    per_prompt = [correct[i * k : (i + 1) * k] for i in range(len(tasks))]
    return {
        "eval/avg_at_k": sum(correct) / len(correct),
        "eval/pass_at_k": sum(any(c) for c in per_prompt) / len(tasks),
        "eval/response_length": sum(len(o.token_ids) for o in outs) / len(outs),
        # the sample behind avg@k, for its interval (report.py): prompts are the unit, k samples each
        "eval/num_prompts": float(len(tasks)),
        "eval/samples_per_prompt": float(k),
        "eval/avg_at_k_stderr": _standard_error([sum(c) / k for c in per_prompt]),
    }


def _standard_error(values: list[float]) -> float:
    """Standard error of the mean of `values` (sample standard deviation / sqrt(n)); 0 for one value."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
