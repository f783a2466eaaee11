"""GRPO with the BAPO loss on rollout groups: group-normalised advantages, the token batch, and the
optimizer updates (several per rollout batch: the paper's staleness)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bapo_nemo.algorithm import BAPOConfig, bapo_policy_loss, importance_ratio, search_clip_bounds
from bapo_nemo.embedded.model.policy import token_logprobs_and_entropy
from bapo_nemo.rollout import RolloutGroup


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(group)) / (std(group) + eps); a group with equal rewards gets zeros."""
    centred = rewards - rewards.mean()
    return centred / (rewards.std(unbiased=True) + eps) if rewards.numel() > 1 else centred


@dataclass
class TokenBatch:
    """Sequences = prompt + response, right-padded. Per-token tensors are [N, S-1]: position t scores token
    t+1, and `mask` marks response tokens that enter the loss."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    loss_weights: torch.Tensor
    token_versions: torch.Tensor
    advantages: torch.Tensor  # [N, 1]
    rewards: torch.Tensor  # [N]
    group_index: torch.Tensor  # [N]

    def select(self, rows: list[int]) -> TokenBatch:
        idx = torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)
        width = int(self.attention_mask[idx].sum(-1).max())  # drop columns that are padding for all rows
        fields = {}
        for name, value in self.__dict__.items():
            value = value[idx]
            if value.dim() == 2 and value.shape[1] > 1:
                value = value[:, : width if name in ("input_ids", "attention_mask") else width - 1]
            fields[name] = value
        return TokenBatch(**fields)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(**{name: value.to(device) for name, value in self.__dict__.items()})


def build_batch(groups: list[RolloutGroup], rewards: list[list[float]], pad_token_id: int) -> TokenBatch:
    rollouts = [r for g in groups for r in g.rollouts]
    width = max(len(r.prompt_token_ids) + len(r.response_token_ids) for r in rollouts)
    n = len(rollouts)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask, behavior, weights = (
        torch.zeros((n, width - 1)),
        torch.zeros((n, width - 1)),
        torch.zeros((n, width - 1)),
    )
    versions = torch.zeros((n, width - 1), dtype=torch.long)
    for i, r in enumerate(rollouts):
        p, m = len(r.prompt_token_ids), len(r.response_token_ids)
        ids[i, : p + m] = torch.tensor(r.prompt_token_ids + r.response_token_ids)
        attention[i, : p + m] = 1
        span = slice(p - 1, p - 1 + m)
        weights[i, span] = torch.tensor(r.loss_weights, dtype=torch.float32)
        mask[i, span] = (weights[i, span] > 0).float()  # excluded stale tokens leave the loss entirely
        behavior[i, span] = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
        versions[i, span] = torch.tensor(r.token_versions, dtype=torch.long)
    reward_t = torch.tensor([x for rs in rewards for x in rs], dtype=torch.float32)
    adv = torch.cat([group_advantages(torch.tensor(rs, dtype=torch.float32)) for rs in rewards]).unsqueeze(-1)
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.rollouts])
    return TokenBatch(ids, attention, mask, behavior, weights, versions, adv, reward_t, group_index)


# What one more micro-batch costs (a forward + backward call: per-op overhead), counted in padded tokens:
# a split is worth it when it saves more padding than this. About right for the tiny model (larger ones
# pay less per call relative to a token, so this errs on the side of fewer calls).
MICRO_BATCH_CALL_TOKENS = 32


def length_sorted_micro_batches(batch: TokenBatch, micro_batch_size: int) -> list[list[int]]:
    """Row indices in micro-batches of similar length, each at most `micro_batch_size` rows and trimmed to
    its own longest row. With heavy-tailed lengths, fixed-size slices of the length-sorted rows still pad
    most rows of a slice to its few long ones (about half the tokens of a typical batch are padding), so
    the cut points are chosen to minimise padded tokens + MICRO_BATCH_CALL_TOKENS per micro-batch."""
    lengths = batch.attention_mask.sum(-1).tolist()
    order = sorted(range(len(batch)), key=lambda i: -lengths[i])
    return [order[i:j] for i, j in _padding_cuts([lengths[k] for k in order], micro_batch_size)]


def _padding_cuts(descending: list[int], max_rows: int) -> list[tuple[int, int]]:
    """[start, end) slices of `descending` lengths minimising sum(rows x first length) + a call cost
    per slice (dynamic programming over the cut points; a slice is padded to its first, longest row)."""
    n = len(descending)
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(max(0, end - max_rows), end):
            cost = best[start] + (end - start) * descending[start] + MICRO_BATCH_CALL_TOKENS
            if cost < best[end]:
                best[end], cut[end] = cost, start
    slices, end = [], n
    while end > 0:
        slices.append((cut[end], end))
        end = cut[end]
    return slices[::-1]


@torch.no_grad()
def forward_logprobs(model, batch: TokenBatch, micro_batch_size: int) -> torch.Tensor:
    """Current-policy log-probs of the batch's tokens, without gradient, [N, S-1]."""
    out = torch.zeros_like(batch.behavior_logprobs)
    for rows in length_sorted_micro_batches(batch, micro_batch_size):
        micro = batch.select(rows)
        lp, _ = token_logprobs_and_entropy(model, micro.input_ids, micro.attention_mask, with_entropy=False)
        out[torch.tensor(rows, device=out.device), : lp.shape[1]] = lp
    return out


# Per-micro-batch search statistics that add up over the mini-batch, and fractions with what they are of.
_COUNTS = ("bapo/num_tokens", "bapo/nonfinite_tokens", "bapo/tokens_pos", "bapo/tokens_neg", "bapo/positive_mass",
           "bapo/negative_mass")
_FRACTION_OF = {"bapo/clipfrac_pos": "bapo/tokens_pos", "bapo/clipfrac_neg": "bapo/tokens_neg",
                "bapo/clipfrac_dual": "bapo/tokens_neg"}


def update_metrics(per_micro: list[tuple[float, dict[str, float]]], one_search: bool, enabled: bool) -> dict:
    """One update's search statistics over its whole mini-batch, from its loss calls' (token share, metrics).
    With one search for the mini-batch (granularity step) every call reports that search: taken once. With a
    search per call, counts and masses add up, fractions are weighted by what they are fractions of, other
    values by tokens, and rho is the summed masses' share P / (P + N) (1 without negative mass, as the
    search reports it). So rho is the mini-batch's share at the bounds used, and the token counts are the
    mini-batch's, at either granularity: a fixed-clip run and a BAPO run count the same tokens."""
    if one_search:
        return dict(per_micro[0][1])
    keys = per_micro[0][1]
    out = {key: sum(share * metrics[key] for share, metrics in per_micro) for key in keys}
    for key in _COUNTS:
        if key in keys:
            out[key] = sum(metrics[key] for _, metrics in per_micro)
    for key, of in _FRACTION_OF.items():
        if key in keys:
            total = out[of]
            out[key] = sum(metrics[key] * metrics[of] for _, metrics in per_micro) / total if total > 0 else 0.0
    positive, negative = out.get("bapo/positive_mass", 0.0), out.get("bapo/negative_mass", 0.0)
    if "bapo/rho" in keys:
        out["bapo/rho"] = positive / (positive + negative) if negative > 0 else 1.0
    if "bapo/rho_initial" in keys and not enabled:  # fixed bounds: the starting bounds are the bounds
        out["bapo/rho_initial"] = out["bapo/rho"]
    return out


def policy_update(
    model,
    optimizer,
    batch: TokenBatch,
    old_logprobs: torch.Tensor,
    importance_weights: torch.Tensor,
    bapo: BAPOConfig,
    micro_batch_size: int,
    grad_clip: float,
    step_search_graph_tokens: int = 0,
    entropy_coef: float = 0.0,
) -> dict[str, float]:
    """One optimizer step on `batch` (one mini-batch). The ratio is taken against `old_logprobs`.

    bapo.granularity=step: one bound search over the whole mini-batch, which needs its current log-probs
    before any backward. Up to `step_search_graph_tokens` tokens, the micro-batches' forwards run first
    and keep their graphs (activation memory of the whole mini-batch, no extra compute); above it, an
    extra no-grad forward of the mini-batch runs first. microbatch: one search inside each loss call.
    """
    n_tokens = batch.mask.sum().clamp_min(1.0)
    micro_batches = length_sorted_micro_batches(batch, micro_batch_size)
    model.train()
    bounds = None
    forwards: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    if bapo.enabled and bapo.granularity == "step":
        if float(batch.attention_mask.sum()) <= step_search_graph_tokens:
            forwards, current = [], torch.zeros_like(old_logprobs)
            for rows in micro_batches:
                micro = batch.select(rows)
                lp, entropy = token_logprobs_and_entropy(model, micro.input_ids, micro.attention_mask)
                forwards.append((lp, entropy))
                current[torch.tensor(rows, device=current.device), : lp.shape[1]] = lp.detach()
        else:
            current = forward_logprobs(model, batch, micro_batch_size)
        ratio = importance_ratio(current, old_logprobs)
        bounds = search_clip_bounds(
            ratio, batch.advantages.expand_as(ratio), batch.mask, bapo, weights=importance_weights
        )
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss": 0.0}
    per_micro: list[tuple[float, dict[str, float]]] = []  # (token share, the loss call's metrics)
    entropy_sum = 0.0
    for k, rows in enumerate(micro_batches):
        micro = batch.select(rows)
        width = micro.mask.shape[1]
        if forwards is not None:
            (lp, entropy), forwards[k] = forwards[k], None  # drop the reference: backward frees the graph
        else:
            lp, entropy = token_logprobs_and_entropy(model, micro.input_ids, micro.attention_mask)
        loss, metrics = bapo_policy_loss(
            lp,
            old_logprobs[rows][:, :width],
            micro.advantages,
            micro.mask,
            n_tokens,
            bapo,
            bounds=bounds,
            importance_weights=importance_weights[rows][:, :width],
        )
        masked_entropy = (entropy * micro.mask).sum()
        if entropy_coef:
            loss = loss - entropy_coef * masked_entropy / n_tokens
        loss.backward()
        entropy_sum += float(masked_entropy.detach())
        per_micro.append((float(micro.mask.sum()) / float(n_tokens), metrics))
        sums["loss"] += float(loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    sums.update(update_metrics(per_micro, one_search=bounds is not None, enabled=bapo.enabled))
    sums["entropy"] = entropy_sum / float(n_tokens)
    sums["grad_norm"] = float(grad_norm)
    return sums
