"""Record the policy's own log-probs on a few fixed sequences into every NeMo-RL checkpoint.

`bapo-nemo export` converts a Megatron checkpoint outside the training job, where the model cannot be
loaded, so its parity check compares with `step_N/parity_logprobs.json`, written here while the policy is
live. `parity_writer` is a `CheckpointHooks` writer (checkpoint_hooks.py): one `policy.get_logprobs` call
on a handful of short sequences, into `tmp_step_N`, visible with the checkpoint's rename.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bapo_nemo.export.parity import FIXED_PROMPTS, REFERENCE_FILE, write_reference_logprobs

PARITY_FILE = REFERENCE_FILE


def parity_sequences(tokenizer, prompts: list[str] = FIXED_PROMPTS) -> list[list[int]]:
    """Token ids of the fixed held-out prompts (the same list the export's parity check uses)."""
    return [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]


def _batch(sequences: list[list[int]], pad_id: int, multiple: int) -> dict[str, torch.Tensor]:
    longest = max(len(s) for s in sequences)
    width = -(-longest // multiple) * multiple  # Megatron wants lengths divisible by TP*CP*2
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, : len(s)] = torch.tensor(s)
    return {"input_ids": input_ids, "input_lengths": torch.tensor([len(s) for s in sequences])}


def record_parity_logprobs(policy, step_dir, sequences: list[list[int]], pad_id: int, multiple: int,
                           dtype: str, make_batch: Callable[[dict], Any] = dict) -> None:
    """`policy.get_logprobs` on `sequences` -> `step_dir/parity_logprobs.json`.

    v0.7.0's get_logprobs returns [B, S] with position i = log p(token i | tokens < i) and 0 at i = 0;
    the file stores, per sequence, positions 1..len-1 (log p of each next token)."""
    data = make_batch(_batch(sequences, pad_id, multiple))
    logprobs = policy.get_logprobs(data)["logprobs"].float().cpu()
    rows = [logprobs[i, 1 : len(s)].tolist() for i, s in enumerate(sequences)]
    write_reference_logprobs(step_dir, sequences, rows, dtype, source="nemo-rl policy.get_logprobs at checkpoint save")


def parity_writer(policy, tokenizer, master_config) -> Callable[[Path], bool]:
    """The checkpoint writer of `parity_logprobs.json` (for `CheckpointHooks.add`)."""
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        make_batch: Callable[[dict], Any] = BatchedDataDict
    except ImportError:  # only outside the container (tests): the policy takes a plain dict
        make_batch = dict
    policy_cfg = master_config.policy if hasattr(master_config, "policy") else master_config["policy"]
    multiple = int(policy_cfg.get("make_sequence_length_divisible_by", 1) or 1)
    dtype = str(policy_cfg.get("precision", "bfloat16"))
    sequences = parity_sequences(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def write(tmp_dir: Path) -> bool:
        try:
            record_parity_logprobs(policy, tmp_dir, sequences, pad_id, multiple, dtype, make_batch)
        except Exception as exc:  # noqa: BLE001 - a missing parity file only weakens the export's check; keep training
            print(f"warning: parity log-probs not recorded for {tmp_dir}: {type(exc).__name__}: {exc}", flush=True)
            return False
        return True

    return write
