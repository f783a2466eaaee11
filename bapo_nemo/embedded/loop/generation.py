"""Sampling with a KV cache: temperature-1 sampling that records each sampled token's log-prob, stops
each sequence at EOS or its token limit, and continues from prompt + partial tokens (the partial-rollout
`generate_fn`). Finished rows leave the batch, so the cost follows the live sequences, not the longest;
contexts of very different lengths are prefilled in chunks and decoded as one batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Continuation:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with EOS (the EOS token is included in token_ids)


# A chunk holds contexts of at least this fraction of its longest one: at most half of its prefill is
# padding. Smaller chunks than MIN_CHUNK_ROWS join a neighbour (each chunk costs a prefill call).
CHUNK_LENGTH_RATIO = 0.5
MIN_CHUNK_ROWS = 16


def length_chunks(lengths: list[int]) -> list[list[int]]:
    """Positions of `lengths` grouped into chunks of similar length (longest first): a new chunk starts
    where a context is shorter than CHUNK_LENGTH_RATIO x its chunk's longest, once the chunk has
    MIN_CHUNK_ROWS rows; a last chunk smaller than that joins the previous one."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    chunks: list[list[int]] = []
    for k in order:
        if chunks and (
            len(chunks[-1]) < MIN_CHUNK_ROWS or lengths[k] >= CHUNK_LENGTH_RATIO * lengths[chunks[-1][0]]
        ):
            chunks[-1].append(k)
        else:
            chunks.append([k])
    if len(chunks) > 1 and len(chunks[-1]) < MIN_CHUNK_ROWS:
        last = chunks.pop()
        chunks[-1] += last
    return chunks


def _prefill(model, contexts: list[list[int]], pad_token_id: int, device):
    """One forward over left-padded contexts, positions counted from each row's first real token.
    Returns (KV cache, last logits, attention mask, next positions)."""
    width = max(len(c) for c in contexts)
    input_ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, ctx in enumerate(contexts):
        input_ids[row, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
        attention[row, width - len(ctx) :] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.past_key_values, out.logits[:, -1], attention, positions[:, -1:] + 1


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, [B, heads, T, dim], across transformers' cache layouts."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _merge_prefills(prefills):
    """One decode batch from chunks prefilled separately: each chunk's KV and attention mask are
    left-padded (zeros, masked out) to the widest chunk and stacked along the batch."""
    width = max(attention.shape[1] for _, _, attention, _ in prefills)

    def left_pad(t: torch.Tensor, dim: int) -> torch.Tensor:
        pad = [0, 0] * (t.dim() - 1 - dim) + [width - t.shape[dim], 0]
        return torch.nn.functional.pad(t, pad)

    merged = type(prefills[0][0])()
    for layer, per_chunk in enumerate(zip(*(_layers(cache) for cache, *_ in prefills))):
        keys = torch.cat([left_pad(k, 2) for k, _ in per_chunk])
        values = torch.cat([left_pad(v, 2) for _, v in per_chunk])
        merged.update(keys, values, layer)
    logits = torch.cat([p[1] for p in prefills])
    attention = torch.cat([left_pad(p[2], 1) for p in prefills])
    next_pos = torch.cat([p[3] for p in prefills])
    return merged, logits, attention, next_pos


@torch.no_grad()
def sample_continuations(
    model,
    contexts: list[list[int]],
    max_new_tokens: int | list[int],
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
    compact: bool = True,
) -> list[Continuation]:
    """Sample up to `max_new_tokens` tokens after each context (prompt, or prompt + earlier segments).

    Contexts of very different lengths are prefilled in chunks of similar length (`length_chunks`).
    compact=False keeps finished rows in the batch until every row is done and pads every context to
    the longest (static batching, as HF `generate` does); their extra samples are discarded. Only
    benchmarks use it."""
    n = len(contexts)
    if n == 0:
        return []
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    results = [Continuation([], [], False) for _ in range(n)]
    live = [i for i in range(n) if limits[i] > 0]
    if not live:
        return results
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device

    # Prefill. Contexts of very different lengths (long resumed responses next to fresh prompts, a few
    # long questions) are prefilled in chunks of similar length, each left-padded to its own longest,
    # and their KV caches merged into one decode batch: padding everything to the longest context made
    # most of the prefill padding.
    chunks = length_chunks([len(contexts[i]) for i in live]) if compact else [list(range(len(live)))]
    prefills = [_prefill(model, [contexts[live[k]] for k in c], pad_token_id, device) for c in chunks]
    order = [live[k] for chunk in chunks for k in chunk]  # batch row -> sequence index
    if len(prefills) == 1:
        cache, logits, attention, next_pos = prefills[0]
    else:
        cache, logits, attention, next_pos = _merge_prefills(prefills)
    rows = torch.tensor(order)
    active = [True] * len(order)  # static batching only: rows still generating

    for _ in range(max(limits[i] for i in live)):
        log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
        token_lp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        keep = []
        for row, (seq, tok, lp) in enumerate(zip(rows.tolist(), tokens.tolist(), token_lp.tolist())):
            if not active[row]:
                continue
            res = results[seq]
            res.token_ids.append(tok)
            res.logprobs.append(lp)
            if tok == eos_token_id:
                res.finished = True
            elif len(res.token_ids) < limits[seq]:
                keep.append(row)
        if not keep:
            break
        if not compact:
            active = [row in set(keep) for row in range(len(rows))]
        elif len(keep) < len(rows):
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            rows, tokens = rows[torch.tensor(keep)], tokens[idx]
            attention, next_pos = attention[idx], next_pos[idx]
            active = [True] * len(keep)
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
        out = model(
            input_ids=tokens.unsqueeze(-1),
            attention_mask=attention,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
        )
        cache, logits = out.past_key_values, out.logits[:, -1]
        next_pos = next_pos + 1
    model.train(was_training)
    return results
