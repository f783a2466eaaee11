"""Sampling with a KV cache: temperature-1 sampling that records each sampled token's log-prob, stops
each sequence at EOS or its token limit, and continues from prompt + partial tokens (the partial-rollout
`generate_fn`). Finished rows leave the batch, so the cost follows the live sequences, not the longest."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Continuation:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with EOS (the EOS token is included in token_ids)


# A chunk holds contexts of at least this fraction of its longest one: at most half of its prefill is
# padding. Smaller chunks than MIN_CHUNK_ROWS join a neighbour (each chunk costs its own decode calls).
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

    Contexts of very different lengths are generated in chunks of similar length (`length_chunks`).
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
    if compact:
        chunks = length_chunks([len(contexts[i]) for i in live])
        if len(chunks) > 1:
            # Contexts of very different lengths (long resumed responses next to fresh prompts, or a few
            # long questions): left-padding all to the longest wastes most of the prefill. Generate each
            # chunk of similar lengths as its own batch.
            for chunk in chunks:
                rows = [live[k] for k in chunk]
                outs = sample_continuations(
                    model, [contexts[i] for i in rows], [limits[i] for i in rows], eos_token_id,
                    pad_token_id, generator, temperature, compact,
                )
                for i, out in zip(rows, outs):
                    results[i] = out
            return results
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device

    # Prefill: left-padded contexts, positions counted from each row's first real token.
    width = max(len(contexts[i]) for i in live)
    input_ids = torch.full((len(live), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(live), width), dtype=torch.long)
    for row, i in enumerate(live):
        ctx = contexts[i]
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
    cache, logits = out.past_key_values, out.logits[:, -1]
    next_pos = positions[:, -1:] + 1
    rows = torch.tensor(live)  # batch row -> sequence index
    active = [True] * len(live)  # static batching only: rows still generating

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
