"""What one RL step logs (`step_metrics`, the sample table's `sample_rows`), and the watch on its learning
signal (`ZeroSpreadWatch`; `from_scratch_stop` for a random model that cannot start learning).

`frac_reward_zero_std` (TRL's name) is the share of the step's fresh groups whose rewards all tie (zero
advantages). A step without such signal in any mini-batch logs no `bapo/rho` (P / (P + N) is 0 / 0; the
report draws a gap) instead of the 1.0 the bound search reports for an empty mini-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bapo_nemo.embedded.loop.rl_step import StepOutcome

# MLflow run tag holding the latest zero-spread warning (the UI shows it on the run's page).
ZERO_SPREAD_TAG = "bapo.warning.zero_reward_spread"
_SHARES = ("bapo/rho", "bapo/rho_initial")


def frac_reward_zero_std(rewards: list[list[float]]) -> float:
    """Share of groups whose rewards all equal each other (TRL's `frac_reward_zero_std`)."""
    return sum(1 for group in rewards if max(group) == min(group)) / len(rewards)


def step_metrics(outcome: StepOutcome, version: int) -> dict[str, float]:
    """The step's metrics for MLflow, metrics.jsonl and the per-step line."""
    updates, t = outcome.updates, outcome.times
    fresh_groups = outcome.rewards[: len(outcome.groups)]
    fresh = [x for rs in fresh_groups for x in rs]
    lengths = [len(r.response_token_ids) for g in outcome.groups for r in g.rollouts]
    # correct vs wrong response lengths: when wrong ones are longer, negative tokens dominate the loss
    correct = [n for n, x in zip(lengths, fresh) if x > 0]
    wrong = [n for n, x in zip(lengths, fresh) if x <= 0]
    generated = outcome.generated_tokens
    metrics = {key: sum(u[key] for u in updates) / len(updates) for key in updates[0]}
    # The share is averaged over the mini-batches that have advantage mass; with none, it is undefined.
    signal = [u for u in updates if u.get("bapo/positive_mass", 0) + u.get("bapo/negative_mass", 0) > 0]
    for key in _SHARES:
        if key not in metrics:
            continue
        if signal:
            metrics[key] = sum(u[key] for u in signal) / len(signal)
        else:
            del metrics[key]
    metrics.update(
        {
            "reward/mean": sum(fresh) / len(fresh),
            "frac_reward_zero_std": frac_reward_zero_std(fresh_groups),
            "train/accuracy": sum(1.0 for x in fresh if x > 0) / len(fresh),
            "train/response_length_mean": sum(lengths) / len(lengths),
            "train/response_length_max": float(max(lengths)),
            **({"train/response_length_correct": sum(correct) / len(correct)} if correct else {}),
            **({"train/response_length_wrong": sum(wrong) / len(wrong)} if wrong else {}),
            "train/token_staleness_mean": outcome.token_staleness,
            "train/replayed_groups": float(len(outcome.replayed)),
            "train/policy_version": float(version),
            "perf/generated_tokens": float(generated),
            "perf/generation_tokens_per_s": generated / max(t["generated"] - t["start"], 1e-9),
            "perf/tokens_per_s": generated / max(t["end"] - t["start"], 1e-9),
            "perf/step_time_s": t["end"] - t["start"],
            "perf/step_cpu_s": t["cpu"],  # = wall time alone on the machine (1 thread)
            **{k: v for k, v in outcome.rollout_stats.items() if not k.startswith("rollout/segments_hist")},
        }
    )
    return metrics


@dataclass
class ZeroSpreadWatch:
    """Says once per streak when, for `steps` consecutive steps, more than `most` of the groups had zero
    reward spread: the run is spending its compute on rollouts it cannot learn from."""

    most: float = 0.5
    steps: int = 3
    streak: int = 0
    seen: int = 0  # steps this process has watched
    leading_zero_steps: int = 0  # of those, how many in a row from the first scored exactly 0

    def update(self, step: int, frac_zero_std: float, reward_mean: float) -> str | None:
        self.streak = self.streak + 1 if frac_zero_std > self.most else 0
        if reward_mean == 0.0 and self.leading_zero_steps == self.seen:
            self.leading_zero_steps += 1
        self.seen += 1
        if self.streak != self.steps:
            return None
        if reward_mean == 0.0:
            why = ("every reward was 0: no response matched its reference answer (a model still too weak for "
                   "the tasks, or answers the reward cannot match: check data.reward and how the answers are "
                   "written)")
        elif reward_mean == 1.0:
            why = "every response was right: the tasks are too easy for this model"
        else:
            why = ("most groups' responses were all right or all wrong (raise grpo.num_generations_per_prompt or "
                   "policy.generation.temperature)")
        return (f"no learning signal in steps {step - self.steps + 1}-{step}: frac_reward_zero_std "
                f"{frac_zero_std:.2f} (share of groups whose responses all got the same reward, so zero "
                f"advantage and no gradient); {why}")


class NoLearningSignalError(RuntimeError):
    """A randomly initialised policy without warm-up scored exactly 0 for its first steps: GRPO has no
    advantage to follow, so the rest of the run would train nothing."""


# Steps a randomly initialised policy may score exactly 0 before the run stops: its responses are random
# strings, and one right answer in that many groups would already be a surprise.
FROM_SCRATCH_ZERO_STEPS = 3


def from_scratch_stop(step: int, leading_zero_steps: int, from_scratch: bool,
                      warmup_steps_fix: int = 500) -> str | None:
    """Why the run stops at `step`, or None: it started (step 1 in this process) from a randomly initialised
    model with no warm-up (`from_scratch`) and each of its first FROM_SCRATCH_ZERO_STEPS steps scored exactly 0."""
    if not from_scratch or step != FROM_SCRATCH_ZERO_STEPS or leading_zero_steps != step:
        return None
    return (f"no learning signal: every reward of the first {step} steps was exactly 0 (frac_reward_zero_std 1.00) "
            "and a randomly initialised model (policy.model_name null) with warmup.steps=0 cannot find a right "
            "answer to learn from; stopped instead of training on: set warmup.steps="
            f"{warmup_steps_fix} (the supervised warm-up of configs/local_cpu.yaml), or start from a pretrained "
            "model, e.g. policy.model_name=smollm2-135m-instruct (bundled, offline)")


def sample_rows(tokenizer, groups, rewards, step: int, n: int) -> list[dict]:
    """The first response of each of the step's first `n` groups, for the MLflow table of samples."""
    from bapo_nemo.embedded.loop.evaluation import (
        decode_response,  # torch; the NeMo-RL hook imports this module
    )

    rows = []
    for g, rs in zip(groups, rewards):
        r = g.rollouts[0]
        rows.append(
            {
                "step": step,
                "prompt": r.meta["question"],
                "answer": r.meta["answer"],
                "response": decode_response(tokenizer, r.response_token_ids),
                "reward": rs[0],
                "num_segments": r.num_segments,
                "length": len(r.response_token_ids),
            }
        )
        if len(rows) >= n:
            break
    return rows


def finite(metrics: dict) -> dict[str, float]:
    """The metrics MLflow takes: numbers, without None, NaN or infinity."""
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
