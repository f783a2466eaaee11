"""NeMo-RL's data shapes for partial rollouts, as plain functions on dicts and tensors (no NeMo-RL
import): dataloader rows as JSON (they are checkpointed with the in-flight segments), segment contexts as
`GenerationDatumSpec` inputs, `GenerationOutputSpec` outputs as segments, finished responses replayed as
one generation call, and the stale prefix of a response split off for `stale_segments: exclude`.
The hook that drives them through grpo_train is `bapo_nemo.nemo.partial_rollout`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from bapo_nemo.rollout import GenerationChunk, Rollout

_TENSOR_TAG = "__tensor__"


class PartialRolloutSetupError(ValueError):
    """The NeMo-RL config cannot run partial rollouts as set; the message names the key and the fix."""




# ---- JSON encoding of dataloader rows (they are checkpointed with the in-flight segments) -------------
def _encode_value(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        return {_TENSOR_TAG: value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, Mapping):
        return {str(k): _encode_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise PartialRolloutSetupError(
        f"partial rollouts checkpoint every queued prompt row as JSON, but batch field {where} holds a "
        f"{type(value).__name__}; multimodal rows (images, audio) are not supported with partial_rollouts"
    )


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR_TAG in value:
            return torch.tensor(value[_TENSOR_TAG], dtype=getattr(torch, value["dtype"]))
        return {k: _decode_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    return value


def encode_row(batch: Mapping, index: int) -> dict:
    """Row `index` of a batch (tensor columns sliced, list columns indexed) as JSON-safe data."""
    row = {}
    for key, column in batch.items():
        if isinstance(column, torch.Tensor):
            row[key] = {"column": "tensor", "value": _encode_value(column[index], key)}
        else:
            row[key] = {"column": "list", "value": _encode_value(column[index], key)}
    return row


def decode_rows(rows: list[dict]) -> dict[str, Any]:
    """Columns rebuilt from encoded rows: tensor columns stacked, list columns as lists."""
    if not rows:
        return {}
    columns: dict[str, Any] = {}
    for key, spec in rows[0].items():
        values = [_decode_value(r[key]["value"]) for r in rows]
        columns[key] = torch.stack(values) if spec["column"] == "tensor" else values
    return columns


def prompt_token_ids(message_log: list[Mapping]) -> list[int]:
    """The prompt as generation sees it: every message's token_ids, concatenated."""
    return [int(t) for m in message_log for t in m["token_ids"].tolist()]


def check_prompt_blocks(batch: Mapping, group_size: int) -> int:
    """Number of prompts P in a `repeat_interleave(G)`d batch; each block of G rows must hold one prompt."""
    message_logs = batch["message_log"]
    n = len(message_logs)
    if n % group_size:
        raise ValueError(
            f"rollout batch has {n} rows, not a multiple of grpo.num_generations_per_prompt={group_size}"
        )
    for start in range(0, n, group_size):
        first = prompt_token_ids(message_logs[start])
        for r in range(start + 1, start + group_size):
            if prompt_token_ids(message_logs[r]) != first:
                raise ValueError(
                    f"rows {start} and {r} of the rollout batch hold different prompts: partial rollouts expect "
                    "grpo_train's repeat_interleave(num_generations_per_prompt) layout"
                )
    return n // group_size


# ---- generation: segments through the real backend, replay of finished responses ---------------------
def generation_inputs(contexts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`GenerationDatumSpec` tensors: right-padded input_ids [n, max_len] and input_lengths [n]."""
    lengths = torch.tensor([len(c) for c in contexts], dtype=torch.int32)
    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    for i, c in enumerate(contexts):
        input_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    return input_ids, lengths


def generation_engines(policy_generation: Any) -> int:
    """How many engines a generate call is sharded over: v0.7.0's VllmGeneration shards its rows over
    the `data_parallel` axis of its `sharding_annotations`; a backend without one counts as one."""
    sharding = getattr(policy_generation, "sharding_annotations", None)
    try:
        return max(1, int(sharding.get_axis_size("data_parallel")))
    except (AttributeError, KeyError, TypeError, ValueError):
        return 1


def chunks_from_generation_outputs(
    outputs: Mapping, input_lengths: list[int], max_new_tokens: int, stop_token_ids: tuple[int, ...] = ()
) -> list[GenerationChunk]:
    """`GenerationOutputSpec` -> one GenerationChunk per row. The generated tokens of row i are
    output_ids[i, input_len:unpadded_len] with their log-probs at the same positions. A row ended
    (finished) unless `truncated` says it hit max_tokens; backends without `truncated` (Megatron) count a
    row as ended when it stopped short of `max_new_tokens`. Ending on a stop token is always an end.
    Tokens past `max_new_tokens` are cut off (and the row is then not finished)."""
    output_ids, logprobs = outputs["output_ids"], outputs["logprobs"]
    unpadded = outputs["unpadded_sequence_lengths"]
    truncated = outputs.get("truncated")
    chunks = []
    for i, start in enumerate(input_lengths):
        end = int(unpadded[i])
        tokens = [int(t) for t in output_ids[i, start:end].tolist()]
        lps = [float(x) for x in logprobs[i, start:end].tolist()]
        finished = (not bool(truncated[i])) if truncated is not None else len(tokens) < max_new_tokens
        if len(tokens) > max_new_tokens:
            tokens, lps, finished = tokens[:max_new_tokens], lps[:max_new_tokens], False
        if tokens and tokens[-1] in stop_token_ids:
            finished = True
        chunks.append(GenerationChunk(tokens, lps, finished))
    return chunks


def replay_generation_outputs(
    input_ids: torch.Tensor, input_lengths: torch.Tensor, rollouts: list[Rollout], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """`GenerationOutputSpec` tensors for finished rollouts, as if generated in one call: output_ids =
    prompt + response (right-padded), logprobs 0 on the prompt, `truncated` from our length caps."""
    in_lens = [int(x) for x in input_lengths]
    totals = [n + len(r.response_token_ids) for n, r in zip(in_lens, rollouts)]
    width = max(max(totals), input_ids.shape[1])
    output_ids = torch.full((len(rollouts), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(rollouts), width), dtype=torch.float32)
    for i, (n, r) in enumerate(zip(in_lens, rollouts)):
        output_ids[i, :n] = input_ids[i, :n]
        output_ids[i, n : totals[i]] = torch.tensor(r.response_token_ids, dtype=torch.long)
        logprobs[i, n : totals[i]] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    return {
        "output_ids": output_ids,
        "logprobs": logprobs,
        "generation_lengths": torch.tensor([len(r.response_token_ids) for r in rollouts], dtype=torch.long),
        "unpadded_sequence_lengths": torch.tensor(totals, dtype=torch.long),
        "truncated": torch.tensor([r.truncated for r in rollouts], dtype=torch.bool),
    }


class ReplayGeneration:
    """Generation backend that hands back responses already generated segment by segment. Used only for
    the single `generate` call inside the original `run_multi_turn_rollout` (max_rollout_turns=1)."""

    def __init__(self, rollouts: list[Rollout], pad_token_id: int, wrap: Callable[[dict], Any] = dict):
        self.rollouts, self.pad_token_id, self.wrap = rollouts, pad_token_id, wrap
        self.calls = 0

    def generate(self, data: Mapping, greedy: bool = False) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                "ReplayGeneration serves one generation turn; partial rollouts are single-turn"
            )
        input_ids, input_lengths = data["input_ids"], data["input_lengths"]
        if len(input_ids) != len(self.rollouts):
            raise RuntimeError(f"replay got {len(input_ids)} rows for {len(self.rollouts)} finished rollouts")
        for i, r in enumerate(self.rollouts):
            got = input_ids[i, : int(input_lengths[i])].tolist()
            if got != r.prompt_token_ids:
                raise RuntimeError(
                    f"replay row {i}: the batch's prompt differs from rollout {r.prompt_id}'s prompt"
                )
        return self.wrap(
            replay_generation_outputs(input_ids, input_lengths, self.rollouts, self.pad_token_id)
        )


def exclude_stale_prefix(message_log: list[dict], assistant_index: int, num_stale: int) -> None:
    """Split the generated assistant message so its first `num_stale` tokens (sampled by older policies)
    carry no `generation_logprobs`: grpo's `add_grpo_token_loss_masks_and_generation_logprobs` then
    gives them token_loss_mask 0. The full text stays on the trainable (last) part, so environments that
    join or read the last assistant message see the whole response."""
    if num_stale <= 0:
        return
    message = message_log[assistant_index]
    if message.get("role") != "assistant" or "generation_logprobs" not in message:
        raise RuntimeError(f"message {assistant_index} is not the generated assistant message")
    tokens, lps = message["token_ids"], message["generation_logprobs"]
    stale = {"role": "assistant", "content": "", "token_ids": tokens[:num_stale]}
    fresh = dict(message, token_ids=tokens[num_stale:], generation_logprobs=lps[num_stale:])
    message_log[assistant_index : assistant_index + 1] = [stale, fresh]
