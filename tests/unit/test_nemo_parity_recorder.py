"""Parity log-probs recorded at NeMo-RL checkpoint time are what `bapo-nemo export` compares against.

A boundary stand-in, because NeMo-RL's Ray policy does not run here: the policy's `get_logprobs` follows
NeMo-RL's contract ([B, S], position i = log p(token i | tokens < i), 0 at i = 0) computed by a real tiny
HF Qwen2. How the writer reaches a real CheckpointManager's checkpoints is tests/nemo_rl/test_checkpoint_hooks.py."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.embedded.model.tokenizer import load_tokenizer
from bapo_nemo.export.parity import compare, read_reference_logprobs, token_logprobs
from bapo_nemo.nemo.parity_recorder import parity_writer


class HFBackedPolicy:
    def __init__(self, model):
        self.model = model.eval()
        self.calls = []

    @torch.no_grad()
    def get_logprobs(self, data):
        ids, lengths = data["input_ids"], data["input_lengths"]
        self.calls.append(tuple(ids.shape))
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        return {"logprobs": torch.cat([torch.zeros(ids.shape[0], 1), lp], dim=1)}


def test_recorded_logprobs_match_the_exports_own_scoring(tmp_path):
    tokenizer = load_tokenizer()
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    ))
    policy = HFBackedPolicy(model)
    config = {"policy": {"make_sequence_length_divisible_by": 8, "precision": "float32"}}
    write = parity_writer(policy, tokenizer, config)

    tmp_step = tmp_path / "tmp_step_3"
    tmp_step.mkdir()
    assert write(tmp_step) is True
    reference = read_reference_logprobs(tmp_step)

    assert policy.calls and policy.calls[0][1] % 8 == 0  # padded to the Megatron divisibility rule
    assert reference["dtype"] == "float32"
    assert [len(lp) for lp in reference["logprobs"]] == [len(s) - 1 for s in reference["sequences"]]
    # The export scores one unpadded sequence at a time: same numbers as the padded batch at save time.
    result = compare(reference["logprobs"], token_logprobs(model, reference["sequences"]), tolerance=1e-4)
    assert result.passed, result.summary()


def test_a_policy_that_fails_leaves_no_file_and_says_so(tmp_path, capsys):
    class BrokenPolicy:
        def get_logprobs(self, data):
            raise RuntimeError("worker lost")

    config = {"policy": {"make_sequence_length_divisible_by": 1, "precision": "bfloat16"}}
    write = parity_writer(BrokenPolicy(), load_tokenizer(), config)
    assert write(tmp_path) is False
    assert list(tmp_path.iterdir()) == []
    assert "parity log-probs not recorded" in capsys.readouterr().out
