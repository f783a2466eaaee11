"""The KV-cache sampler: recorded log-probs are the policy's, sequences stop at EOS or their limit, and a
continuation from prompt + partial tokens is scored exactly like one uninterrupted sequence."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bapo_nemo.embedded.loop.generation import sample_continuations
from bapo_nemo.embedded.model.policy import build_model, token_logprobs_and_entropy
from bapo_nemo.embedded.model.tokenizer import load_tokenizer

torch.set_num_threads(1)
TOK = load_tokenizer()
CFG = SimpleNamespace(
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=128,
    rope_theta=10000.0,
)


def _full_forward_logprobs(model, context, continuation):
    ids = torch.tensor([context + continuation])
    lp, _ = token_logprobs_and_entropy(model, ids, torch.ones_like(ids), with_entropy=False)
    return lp[0, len(context) - 1 :]


def test_recorded_logprobs_match_an_independent_full_forward():
    model = build_model(CFG, TOK, seed=0)
    contexts = [
        [TOK.bos_token_id] + TOK.encode(q, add_special_tokens=False) for q in ["7+5-3?", "2?", "1+2+3+4+5?"]
    ]
    outs = sample_continuations(
        model, contexts, 25, TOK.eos_token_id, TOK.pad_token_id, torch.Generator().manual_seed(0)
    )
    for ctx, out in zip(contexts, outs):
        assert len(out.token_ids) == len(out.logprobs) <= 25
        if out.finished:
            assert out.token_ids[-1] == TOK.eos_token_id and TOK.eos_token_id not in out.token_ids[:-1]
        else:
            assert len(out.token_ids) == 25 and TOK.eos_token_id not in out.token_ids
        ref = _full_forward_logprobs(model, ctx, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_eos_stops_a_sequence_and_the_others_continue():
    model = build_model(CFG, TOK, seed=0)
    # Make EOS certain right after '?' and impossible elsewhere, by bending the model's logits.
    question_mark = TOK.convert_tokens_to_ids("?")
    contexts = [[TOK.bos_token_id, question_mark], [TOK.bos_token_id, 5]]
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        ids = kwargs["input_ids"]
        last = ids[:, -1]
        out.logits[:, -1, TOK.eos_token_id] = torch.where(last == question_mark, 1e4, -1e4)
        return out

    model.forward = forward
    outs = sample_continuations(
        model, contexts, 10, TOK.eos_token_id, TOK.pad_token_id, torch.Generator().manual_seed(1)
    )
    assert outs[0].token_ids == [TOK.eos_token_id] and outs[0].finished
    assert len(outs[1].token_ids) == 10 and not outs[1].finished


def test_continuation_equals_one_uninterrupted_sample():
    """Partial rollouts re-feed prompt + earlier segments. With the same random stream, 6 tokens then
    the rest must score exactly like the uninterrupted continuation."""
    model = build_model(CFG, TOK, seed=2)
    prompt = [TOK.bos_token_id] + TOK.encode("3+4-1?", add_special_tokens=False)
    first = sample_continuations(
        model, [prompt], 6, TOK.eos_token_id, TOK.pad_token_id, torch.Generator().manual_seed(3)
    )[0]
    second = sample_continuations(
        model,
        [prompt + first.token_ids],
        10,
        TOK.eos_token_id,
        TOK.pad_token_id,
        torch.Generator().manual_seed(4),
    )[0]
    joined = first.token_ids + second.token_ids
    ref = _full_forward_logprobs(model, prompt, joined)
    torch.testing.assert_close(torch.tensor(first.logprobs + second.logprobs), ref, atol=1e-4, rtol=0)
    # And a batch mixing a long and a short context (left padding) gives the same log-probs as alone.
    mixed = sample_continuations(
        model,
        [prompt + first.token_ids, [TOK.bos_token_id]],
        10,
        TOK.eos_token_id,
        TOK.pad_token_id,
        torch.Generator().manual_seed(4),
    )[0]
    ref_mixed = _full_forward_logprobs(model, prompt + first.token_ids, mixed.token_ids)
    torch.testing.assert_close(torch.tensor(mixed.logprobs), ref_mixed, atol=1e-4, rtol=0)


def test_bundled_tokenizer_is_what_its_generator_writes(tmp_path):
    import json

    from bapo_nemo.embedded.model.tokenizer import TOKENIZER_DIR, build_tokenizer, save_tokenizer

    save_tokenizer(build_tokenizer(), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((TOKENIZER_DIR / name).read_text()), (
            name
        )
    text = "12+3=15;15-7=8;#8"
    ids = TOK.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and TOK.decode(ids) == text  # one token per character, lossless


def test_length_chunks_split_where_padding_would_dominate():
    from bapo_nemo.embedded.loop.generation import MIN_CHUNK_ROWS, length_chunks

    assert MIN_CHUNK_ROWS == 16  # the cases below are written for it
    # 20 contexts of 100 tokens and 40 of 20: one batch would pad 40 x 80 = 3200 of 5200 prefill tokens.
    lengths = [100] * 20 + [20] * 40
    chunks = length_chunks(lengths)
    assert [sorted({lengths[k] for k in c}) for c in chunks] == [[100], [20]]
    assert sorted(k for c in chunks for k in c) == list(range(60))  # every context exactly once
    # A short context joins its neighbours while a chunk has fewer than 16 rows...
    assert [len(c) for c in length_chunks([100] * 3 + [20] * 40)] == [16, 27]
    # ... and a last chunk of fewer than 16 joins the one before it.
    assert len(length_chunks([100] * 20 + [20] * 10)) == 1
    # Within a factor of 2 of the chunk's longest, contexts stay together.
    assert len(length_chunks([100] * 30 + [50] * 30)) == 1


def test_chunked_prefill_then_one_decode_batch_scores_like_a_full_forward():
    """Contexts of very different lengths are prefilled in separate chunks whose KV caches are merged
    (left-padded) into one decode batch; each row's log-probs must
    still be those of an independent full forward."""
    model = build_model(CFG, TOK, seed=2)
    long_ctx = [TOK.bos_token_id] + TOK.encode("3+4-1+2-5+6+1-3+2+2+4-1+5?", add_special_tokens=False)
    short_ctx = [TOK.bos_token_id] + TOK.encode("1?", add_special_tokens=False)
    contexts = [long_ctx] * 16 + [short_ctx] * 16
    from bapo_nemo.embedded.loop.generation import length_chunks

    assert len(length_chunks([len(c) for c in contexts])) == 2
    outs = sample_continuations(
        model, contexts, 8, TOK.eos_token_id, TOK.pad_token_id, torch.Generator().manual_seed(5)
    )
    for ctx, out in ((contexts[0], outs[0]), (contexts[-1], outs[-1])):
        ref = _full_forward_logprobs(model, ctx, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def test_grouped_query_attention_without_repeated_heads_computes_the_same_policy():
    """`use_gqa_sdpa` (what `prepare_model` selects) leaves the key/value groups to PyTorch's SDPA instead
    of copying each KV head per query head: log-probs, gradients and samples must be those of
    transformers' own sdpa attention, for padded training rows and for left-padded decoding."""
    from bapo_nemo.embedded.model.attention import use_gqa_sdpa

    stock, grouped = build_model(CFG, TOK, seed=4), build_model(CFG, TOK, seed=4)
    use_gqa_sdpa(grouped)
    assert (stock.config._attn_implementation, grouped.config._attn_implementation) == ("sdpa", "sdpa_gqa")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 22, (4, 18), generator=g)
    attention = (torch.arange(18)[None] < torch.tensor([[18], [11], [6], [15]])).long()
    grads = []
    for model in (stock, grouped):
        lp, entropy = token_logprobs_and_entropy(model, ids, attention)
        ((lp + entropy) * attention[:, 1:]).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    contexts = [[TOK.bos_token_id] + TOK.encode(q, add_special_tokens=False) for q in ["7+5-3?", "2?"] * 3]
    outs = [
        sample_continuations(m, contexts, 20, TOK.eos_token_id, TOK.pad_token_id, torch.Generator().manual_seed(7))
        for m in (stock, grouped)
    ]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    for a, b in zip(*outs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
