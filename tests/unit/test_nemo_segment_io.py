"""bapo_nemo.nemo.segment_io, the partial-rollout hook's glue, on plain dicts/tensors shaped exactly like
NeMo-RL v0.7.0's structures at the boundary (`GenerationDatumSpec`, `GenerationOutputSpec`, rl_collate_fn
rows after `repeat_interleave`, message logs)."""

from __future__ import annotations

import json

import pytest
import torch

from bapo_nemo.nemo.segment_io import (
    PartialRolloutSetupError,
    ReplayGeneration,
    check_prompt_blocks,
    chunks_from_generation_outputs,
    decode_rows,
    encode_row,
    exclude_stale_prefix,
    generation_inputs,
)
from bapo_nemo.rollout import Rollout
from tests.support.nemo_rollout_pieces import PAD, collate, datum, grpo_loss_masks, repeat_interleave


def test_rows_round_trip_through_json_with_their_dtypes():
    batch = repeat_interleave(collate([datum(0, [5, 6, 7]), datum(1, [5, 8])]), 2)
    rows = [json.loads(json.dumps(encode_row(batch, i))) for i in range(4)]
    back = decode_rows(rows)
    assert set(back) == set(batch)
    for key in ("length", "loss_multiplier", "batch_max_length"):
        assert torch.equal(back[key], batch[key]) and back[key].dtype == batch[key].dtype
    assert back["extra_env_info"] == batch["extra_env_info"] and back["idx"] == [0, 0, 1, 1]
    for got, want in zip(back["message_log"], batch["message_log"]):
        assert [m["role"] for m in got] == [m["role"] for m in want]
        assert all(torch.equal(a["token_ids"], b["token_ids"]) for a, b in zip(got, want))
    bad = dict(batch, images=[object()] * 4)
    with pytest.raises(PartialRolloutSetupError, match="batch field images holds a object"):
        encode_row(bad, 0)


def test_prompt_blocks_follow_repeat_interleave():
    batch = repeat_interleave(collate([datum(0, [5, 6]), datum(1, [5, 8])]), 3)
    assert check_prompt_blocks(batch, 3) == 2
    with pytest.raises(ValueError, match="not a multiple of grpo.num_generations_per_prompt=4"):
        check_prompt_blocks(batch, 4)
    with pytest.raises(ValueError, match="rows 0 and 1 .* different prompts"):
        check_prompt_blocks(collate([datum(0, [5, 6]), datum(1, [5, 8])]), 2)


def test_generation_tensors_match_the_v070_spec_example():
    # GenerationDatumSpec: right-padded input_ids, input_lengths
    input_ids, lengths = generation_inputs([[101, 2054, 2003], [101, 2054, 2003, 2001, 1996]], pad_token_id=0)
    assert input_ids.tolist() == [[101, 2054, 2003, 0, 0], [101, 2054, 2003, 2001, 1996]]
    assert lengths.tolist() == [3, 5]
    # GenerationOutputSpec docstring example (interfaces.py): input 3 -> 4 generated; input 5 -> 2, truncated
    outputs = {
        "output_ids": torch.tensor(
            [[101, 2054, 2003, 2023, 2003, 1037, 2200, 0], [101, 2054, 2003, 2001, 1996, 3014, 2005, 0]]
        ),
        "logprobs": torch.tensor(
            [[0.0, 0.0, 0.0, -1.2, -0.8, -2.1, -1.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, -0.9, -1.7, 0.0]]
        ),
        "generation_lengths": torch.tensor([4, 2]),
        "unpadded_sequence_lengths": torch.tensor([7, 7]),
        "truncated": torch.tensor([False, True]),
    }
    a, b = chunks_from_generation_outputs(outputs, [3, 5], max_new_tokens=4)
    assert a.token_ids == [2023, 2003, 1037, 2200] and a.finished
    assert a.logprobs == pytest.approx([-1.2, -0.8, -2.1, -1.5])
    assert b.token_ids == [3014, 2005] and not b.finished
    # a backend that over-generates is cut to the requested size (and so not finished)
    (cut,) = chunks_from_generation_outputs({k: v[:1] for k, v in outputs.items()}, [3], max_new_tokens=3)
    assert cut.token_ids == [2023, 2003, 1037] and not cut.finished
    # Megatron's outputs carry no `truncated`: a row that filled the budget is unfinished unless it ended
    # on a stop token (here 2200 plays EOS)
    megatron = {k: v[:1] for k, v in outputs.items() if k != "truncated"}
    (full,) = chunks_from_generation_outputs(megatron, [3], max_new_tokens=4)
    assert not full.finished
    (eos,) = chunks_from_generation_outputs(megatron, [3], max_new_tokens=4, stop_token_ids=(2200,))
    assert eos.finished
    (short,) = chunks_from_generation_outputs(megatron, [3], max_new_tokens=5)
    assert short.finished


def _rollout(prompt, response, logprobs, versions, truncated=False) -> Rollout:
    return Rollout(
        prompt_id="p",
        prompt_token_ids=prompt,
        response_token_ids=response,
        behavior_logprobs=logprobs,
        token_versions=versions,
        loss_weights=[1.0] * len(response),
        num_segments=len(set(versions)),
        segment_lengths=[],
        meta={"truncated": truncated},
    )


def test_replay_outputs_slice_back_to_the_segments():
    prompts = [[1, 2, 3], [4, 5]]
    input_ids, lengths = generation_inputs(prompts, PAD)
    rollouts = [
        _rollout(prompts[0], [7, 8], [-0.5, -0.25], [0, 1]),
        _rollout(prompts[1], [9, 10, 11, 0], [-1.0, -0.5, -0.125, -2.0], [1, 1, 2, 2], truncated=True),
    ]
    out = ReplayGeneration(rollouts, PAD).generate({"input_ids": input_ids, "input_lengths": lengths})
    # output_ids: prompt then response, right-padded to max(3+2, 2+4) = 6
    assert out["output_ids"].tolist() == [[1, 2, 3, 7, 8, PAD], [4, 5, 9, 10, 11, 0]]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 6]
    assert out["generation_lengths"].tolist() == [2, 4]
    assert out["truncated"].tolist() == [False, True]
    # v0.7.0 generate_responses slices output_ids/logprobs[i, input_len:unpadded_len]
    assert out["logprobs"][1, 2:6].tolist() == [-1.0, -0.5, -0.125, -2.0]
    assert out["logprobs"][0, :3].tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="replay row 0"):
        ReplayGeneration(rollouts[::-1], PAD).generate({"input_ids": input_ids, "input_lengths": lengths})


def test_exclude_splits_stale_tokens_out_of_the_loss_mask():
    log = [
        {"role": "user", "content": "q", "token_ids": torch.tensor([1, 2])},
        {
            "role": "assistant",
            "content": "full answer",
            "token_ids": torch.tensor([7, 8, 9, 10, 11]),
            "generation_logprobs": torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5]),
        },
        {"role": "environment", "content": "ok", "token_ids": torch.tensor([3])},
    ]
    exclude_stale_prefix(log, assistant_index=1, num_stale=3)
    assert [m["role"] for m in log] == ["user", "assistant", "assistant", "environment"]
    assert log[1]["token_ids"].tolist() == [7, 8, 9] and "generation_logprobs" not in log[1]
    assert log[2]["token_ids"].tolist() == [10, 11] and log[2][
        "generation_logprobs"
    ].tolist() == pytest.approx([-0.4, -0.5])
    # environments joining the assistant contents still see the whole answer
    assert "".join(m["content"] for m in log if m["role"] == "assistant") == "full answer"
    # the same token sequence; the loss mask keeps only the 2 fresh tokens
    assert [t for m in log for t in m["token_ids"].tolist()] == [1, 2, 7, 8, 9, 10, 11, 3]
    assert grpo_loss_masks(log) == [0, 0, 0, 0, 0, 1, 1, 0]
