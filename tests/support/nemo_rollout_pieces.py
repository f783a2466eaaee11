"""NeMo-RL v0.7.0's structures at the partial-rollout hook's boundary, for CPU tests: dataset rows as its math
data processor builds them (DatumSpec), `rl_collate_fn` batches and `BatchedDataDict.repeat_interleave` on
plain columns, the GRPO loss mask of a message log, a one-turn stand-in for `run_multi_turn_rollout`, and
`ToyGenerationBackend`, a fake at the vLLM boundary (no GPU here): it answers `generate(data, greedy)`
like vLLM's sync path, sampling from the seeded ToyPolicy with the backend's `max_new_tokens` as vLLM's
`max_tokens`, and `truncated` = finish_reason "length"."""

from __future__ import annotations

from copy import deepcopy

import torch

from bapo_nemo.nemo.segment_io import generation_inputs
from tests.support.toy_rollouts import ToyPolicy

PAD = 99
EOS = 0


class ToyGenerationBackend:
    """Fake vLLM sync generation (the GPU boundary): same inputs/outputs as VllmGeneration.generate."""

    def __init__(self, policy: ToyPolicy, max_new_tokens: int, pad_token_id: int = PAD, wrap=dict):
        self.policy, self.max_new_tokens, self.pad, self.wrap = policy, max_new_tokens, pad_token_id, wrap
        self.calls: list[list[list[int]]] = []

    def generate(self, data, greedy: bool = False):
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        contexts = [input_ids[i, : int(n)].tolist() for i, n in enumerate(input_lengths)]
        self.calls.append(contexts)
        chunks = self.policy(contexts, self.max_new_tokens)
        width = input_ids.shape[1] + self.max_new_tokens
        output_ids = torch.full((len(contexts), width), self.pad, dtype=torch.long)
        logprobs = torch.zeros((len(contexts), width))
        for i, (ctx, ch) in enumerate(zip(contexts, chunks)):
            output_ids[i, : len(ctx)] = torch.tensor(ctx)
            output_ids[i, len(ctx) : len(ctx) + len(ch.token_ids)] = torch.tensor(
                ch.token_ids, dtype=torch.long
            )
            logprobs[i, len(ctx) : len(ctx) + len(ch.token_ids)] = torch.tensor(ch.logprobs)
        return self.wrap(
            {
                "output_ids": output_ids,
                "logprobs": logprobs,
                "generation_lengths": torch.tensor([len(c.token_ids) for c in chunks]),
                "unpadded_sequence_lengths": torch.tensor(
                    [len(x) + len(c.token_ids) for x, c in zip(contexts, chunks)]
                ),
                "truncated": torch.tensor([not c.finished for c in chunks]),
            }
        )


def datum(idx: int, prompt: list[int]) -> dict:
    """One dataset row as v0.7.0's math data processor builds it (DatumSpec)."""
    return {
        "message_log": [
            {"role": "system", "content": "sys", "token_ids": torch.tensor(prompt[:1])},
            {"role": "user", "content": f"q{idx}", "token_ids": torch.tensor(prompt[1:])},
        ],
        "length": len(prompt),
        "extra_env_info": {"ground_truth": str(idx)},
        "loss_multiplier": 1.0,
        "idx": idx,
        "task_name": "math",
        "stop_strings": None,
    }


def collate(data: list[dict]) -> dict:
    """Columns as v0.7.0 `rl_collate_fn` returns them."""
    length = torch.tensor([d["length"] for d in data])
    return {
        "message_log": [d["message_log"] for d in data],
        "length": length,
        "loss_multiplier": torch.tensor([d["loss_multiplier"] for d in data]),
        "extra_env_info": [d["extra_env_info"] for d in data],
        "task_name": [d["task_name"] for d in data],
        "idx": [d["idx"] for d in data],
        "batch_max_length": torch.ones_like(length) * length.max(),
        "stop_strings": [d["stop_strings"] for d in data],
    }


def repeat_interleave(batch: dict, g: int) -> dict:
    """v0.7.0 BatchedDataDict.repeat_interleave on plain columns (list items deep-copied)."""
    return {
        k: v.repeat_interleave(g, dim=0)
        if isinstance(v, torch.Tensor)
        else [deepcopy(x) for x in v for _ in range(g)]
        for k, v in batch.items()
    }


def grpo_loss_masks(message_log: list[dict]) -> list[int]:
    """v0.7.0 add_grpo_token_loss_masks_and_generation_logprobs, flattened: 1 for generated assistant
    tokens (messages carrying generation_logprobs), else 0."""
    mask = []
    for m in message_log:
        on = m["role"] == "assistant" and "generation_logprobs" in m
        mask += [int(on)] * len(m["token_ids"])
    return mask


def standin_single_turn_rollout(
    policy_generation, input_batch, tokenizer, task_to_env, max_seq_len, max_rollout_turns=1, greedy=False
):
    """CPU stand-in for v0.7.0 run_multi_turn_rollout with one turn (NeMo-RL does not import on this
    Python): flat prompts -> generate -> assistant message = output_ids[i, in:total] with
    generation_logprobs -> reward from task_to_env -> total_reward, truncated. The real function runs in
    the nemo_rl-marked tests below."""
    logs = input_batch["message_log"]
    contexts = [[int(t) for m in log for t in m["token_ids"].tolist()] for log in logs]
    input_ids, input_lengths = generation_inputs(contexts, tokenizer.pad_token_id)
    out = policy_generation.generate({"input_ids": input_ids, "input_lengths": input_lengths}, greedy=greedy)
    for i, log in enumerate(logs):
        n, total = int(input_lengths[i]), int(out["unpadded_sequence_lengths"][i])
        log.append(
            {
                "role": "assistant",
                "content": " ".join(map(str, out["output_ids"][i, n:total].tolist())),
                "token_ids": out["output_ids"][i, n:total],
                "generation_logprobs": out["logprobs"][i, n:total],
            }
        )
    batch = dict(input_batch)
    batch["total_reward"] = torch.tensor([task_to_env(log) for log in logs], dtype=torch.float32)
    batch["truncated"] = out["truncated"].clone()
    return batch, {"mean_gen_tokens_per_sample": float(out["generation_lengths"].float().mean())}


class PadOnlyTokenizer:
    pad_token_id = PAD


def master_config(**over) -> dict:
    """A minimal v0.7.0 master config with a partial_rollouts block; `section__key=value` overrides."""
    cfg = {
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_rollout_turns": 1},
        "policy": {"max_total_sequence_length": 64, "generation": {"backend": "vllm", "max_new_tokens": 12}},
        "loss_fn": {"use_importance_sampling_correction": True},
        "env": {},
        "partial_rollouts": {"token_budget": 4, "max_resumptions": 5},
    }
    for path, value in over.items():
        section, key = path.split("__")
        cfg[section][key] = value
    return cfg


def prompt_batches(n: int, first: int = 0) -> list[dict]:
    """n dataloader batches of 2 prompts each (rl_collate_fn columns), prompt i = [5, i + 1]."""
    return [collate([datum(i, [5, i + 1]), datum(i + 1, [5, i + 2])]) for i in range(first, first + 2 * n, 2)]


# What grpo_train hands CheckpointManager in the partial-rollout tests.
CHECKPOINTING = {
    "metric_name": None,
    "higher_is_better": False,
    "keep_top_k": 3,
    "save_optimizer": False,
    "save_period": 1,
}


def finalize_as_grpo_does(checkpointer, path) -> None:
    """What the installed grpo_train does after writing a checkpoint: v0.7.0 renames it at once; main
    renames it on a background thread (begin_finalization) that grpo_train joins before the next save."""
    if hasattr(checkpointer, "begin_finalization"):
        checkpointer.begin_finalization(path, wait_fn=None)
        checkpointer.finalize_pending()
    else:
        checkpointer.finalize_checkpoint(path)
