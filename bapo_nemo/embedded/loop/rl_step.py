"""One RL step of the embedded trainer, read top to bottom: rollout -> reward -> advantage -> BAPO update.

`rl_step(learner)` takes `grpo.num_prompts_per_step` complete prompt groups from the partial-rollout
manager (unfinished responses stay in flight), adds replayed groups, scores every response, turns the
rewards into GRPO advantages and runs `train.updates_per_batch` BAPO updates. It returns a `StepOutcome`;
logging, evaluation and checkpoints are the trainer's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bapo_nemo.embedded.config.run_config import RunConfig
from bapo_nemo.embedded.data.tasks import TaskStream
from bapo_nemo.embedded.loop.generation import sample_continuations
from bapo_nemo.embedded.loop.grpo import TokenBatch, build_batch, forward_logprobs, policy_update
from bapo_nemo.rollout import (
    GenerationChunk,
    PartialRolloutManager,
    PromptItem,
    ReplayBuffer,
    RolloutGroup,
    split_minibatches,
)


@dataclass
class Learner:
    """Everything an RL step reads and advances: the policy and its optimizer, the task stream, the
    rollouts in flight, the replay buffer, the random streams, and the policy version (one per update).

    `encode(task)` gives a task's prompt token ids; `reward(rollout)` scores one finished response."""

    cfg: RunConfig
    model: Any
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    stream: TaskStream
    manager: PartialRolloutManager
    replay: ReplayBuffer
    sample_gen: torch.Generator  # generation
    shuffle_gen: torch.Generator  # mini-batch split and replay sampling
    encode: Callable[[Any], list[int]]
    reward: Callable[[Any], float]
    version: int = 0


@dataclass
class StepOutcome:
    groups: list[RolloutGroup]  # fresh groups completed this step
    replayed: list[RolloutGroup]
    rewards: list[list[float]]  # per group of groups + replayed
    updates: list[dict[str, float]]  # one dict of loss metrics per optimizer update
    token_staleness: float
    generated_tokens: int
    rollout_stats: dict[str, float]
    times: dict[str, float] = field(default_factory=dict)  # start, generated, end (perf_counter); cpu


def rl_step(learner: Learner) -> StepOutcome:
    cfg = learner.cfg
    t_start, cpu_start = time.perf_counter(), time.process_time()

    # 1. rollout: complete groups only; replayed groups join the batch
    groups, generated = collect_groups(learner, cfg.grpo.num_prompts_per_step)
    rollout_stats = learner.manager.stats(learner.version)
    t_generated = time.perf_counter()
    replayed = (
        learner.replay.sample(cfg.replay.groups_per_step, learner.version, learner.shuffle_gen)
        if cfg.replay.groups_per_step
        else []
    )
    batch_groups = groups + replayed

    # 2. reward (a response cut off without EOS scores 0)
    rewards = [[learner.reward(r) if not r.truncated else 0.0 for r in g.rollouts] for g in batch_groups]

    # 3. advantage: GRPO, normalised within each group
    batch = build_batch(batch_groups, rewards, learner.tokenizer.pad_token_id)
    batch = batch.to(next(learner.model.parameters()).device)

    # 4. BAPO update: updates_per_batch optimizer updates, each on one mini-batch of whole groups
    updates, staleness = bapo_updates(learner, batch, len(batch_groups))

    learner.replay.add(groups, _oldest_version(groups, learner.version))
    return StepOutcome(
        groups,
        replayed,
        rewards,
        updates,
        staleness,
        generated,
        rollout_stats,
        {
            "start": t_start,
            "generated": t_generated,
            "end": time.perf_counter(),
            "cpu": time.process_time() - cpu_start,
        },
    )


def collect_groups(learner: Learner, n_groups: int) -> tuple[list[RolloutGroup], int]:
    """`n_groups` complete groups (those finished in earlier steps first), starting new prompts up to the
    in-flight cap. Returns the groups and the number of tokens generated for them."""
    cfg, manager = learner.cfg, learner.manager
    in_flight_cap = cfg.partial_rollouts.max_in_flight_groups or 2 * cfg.grpo.num_prompts_per_step
    groups, generated = manager.take_completed(learner.version, n_groups), 0
    while len(groups) < n_groups:
        queued = manager.num_pending + manager.num_in_flight + manager.num_completed
        if queued < in_flight_cap:
            manager.add_prompts(
                [
                    PromptItem(
                        t.prompt_id, learner.encode(t), {"question": t.question, "answer": t.answer, **t.meta}
                    )
                    for t in learner.stream.next(in_flight_cap - queued)
                ]
            )
        groups += manager.run_iteration(_generate_fn(learner), learner.version, n_groups - len(groups))
        generated += manager.stats(learner.version)["rollout/tokens_last_iteration"]
    return groups, generated


def bapo_updates(learner: Learner, batch: TokenBatch, n_groups: int) -> tuple[list[dict[str, float]], float]:
    """The optimizer updates on one rollout batch. Returns each update's metrics and the batch's mean token
    staleness (policy versions between generation and this step)."""
    cfg = learner.cfg
    # the ratio's reference: behaviour log-probs, or proximal ones recomputed now (then the behaviour gap
    # pi_prox / pi_gen enters as a truncated importance weight)
    weights = batch.loss_weights
    if cfg.loss_fn.bapo.ratio_reference == "proximal":
        old = forward_logprobs(learner.model, batch, cfg.policy.train_micro_batch_size)
        gap = torch.exp(torch.clamp(old - batch.behavior_logprobs, -20, 20))
        cap = cfg.loss_fn.truncated_importance_sampling_ratio
        weights = weights * torch.clamp(gap, max=cap) * batch.mask
    else:
        old = batch.behavior_logprobs
    staleness = ((learner.version - batch.token_versions) * batch.mask).sum() / batch.mask.sum().clamp_min(1)

    updates = []
    n_updates = min(cfg.train.updates_per_batch, n_groups)
    group_size = cfg.grpo.num_generations_per_prompt
    for rows in split_minibatches(len(batch), n_updates, group_size, learner.shuffle_gen):
        mb = batch.select(rows)
        width = mb.mask.shape[1]
        updates.append(
            policy_update(
                learner.model,
                learner.optimizer,
                mb,
                old[rows][:, :width],
                weights[rows][:, :width],
                cfg.loss_fn.bapo,
                cfg.policy.train_micro_batch_size,
                cfg.policy.max_grad_norm,
                cfg.train.step_search_graph_tokens,
                cfg.loss.entropy_coef,
            )
        )
        learner.version += 1
    return updates, float(staleness)


def _generate_fn(learner: Learner) -> Callable[[list[list[int]], int], list[GenerationChunk]]:
    """The manager's `generate_fn`: sample continuations of the contexts with the current policy."""
    tokenizer = learner.tokenizer

    def generate(contexts: list[list[int]], max_new_tokens: int) -> list[GenerationChunk]:
        outs = sample_continuations(
            learner.model,
            contexts,
            max_new_tokens,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            learner.sample_gen,
            learner.cfg.policy.generation.temperature,
        )
        return [GenerationChunk(o.token_ids, o.logprobs, o.finished) for o in outs]

    return generate


def _oldest_version(groups: list[RolloutGroup], default: int) -> int:
    """The policy version of the oldest token in `groups` (the replay buffer ages groups from it)."""
    return min((min(r.token_versions, default=default) for g in groups for r in g.rollouts), default=default)
