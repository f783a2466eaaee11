"""Where a run's prompts, held-out tasks and rewards come from: your dataset when `data.train.data_path` is
set (prompts fitted to the context window, graded by `data.reward`), otherwise the bundled tasks
(generated arithmetic, or `task.*` JSONL files, graded by the bundled rule)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from bapo_nemo.embedded.config import RunConfig
from bapo_nemo.embedded.data import DataError, fit_prompts, load_data, truncate_prompt, unrepresentable_text
from bapo_nemo.embedded.evaluation import decode_response, encode_prompt
from bapo_nemo.embedded.rewards import reward_function
from bapo_nemo.embedded.tasks import Task, TaskGenerator, load_jsonl_tasks, reward


class TaskSource(NamedTuple):
    encode: Callable[[Task], list[int]]  # task -> prompt token ids
    eval_tasks: list[Task]  # held out
    pool: list[Task] | None  # the training tasks; None: generated ones
    score: Callable[[str, Task], float]  # (response text, task) -> reward


def task_source(cfg: RunConfig, tokenizer, context_window: int) -> TaskSource:
    """The run's tasks; a prompt must leave `partial_rollouts.max_response_tokens` of the context window."""
    max_prompt = context_window - cfg.partial_rollouts.max_response_tokens
    if max_prompt < 1:
        raise DataError(
            f"partial_rollouts.max_response_tokens={cfg.partial_rollouts.max_response_tokens} leaves no room "
            f"for a prompt in the model's context window of {context_window} tokens: lower it"
        )

    def encode(task: Task) -> list[int]:
        return encode_prompt(tokenizer, task.question)

    if cfg.data.train.data_path is None:
        eval_tasks = (
            load_jsonl_tasks(cfg.task.eval_file, cfg.task.max_bad_fraction, max_prompt)
            if cfg.task.eval_file
            else TaskGenerator(
                cfg.task.eval_seed,
                cfg.task.min_ops,
                cfg.task.max_ops,
                cfg.task.tail_alpha,
                cfg.task.max_value,
                cfg.task.max_operand,
                prefix="eval",
            ).sample(cfg.task.eval_size)
        )
        pool = (
            load_jsonl_tasks(cfg.task.train_file, cfg.task.max_bad_fraction, max_prompt)
            if cfg.task.train_file
            else None
        )
        return TaskSource(encode, eval_tasks, pool, reward)

    pool, eval_tasks = load_data(
        cfg.data, cfg.task.eval_seed, unrepresentable_text(tokenizer, cfg.data.prompt_template)
    )
    pool = fit_prompts(pool, encode, max_prompt, cfg.data.overlong_prompts, "training")
    eval_tasks = fit_prompts(eval_tasks, encode, max_prompt, cfg.data.overlong_prompts, "held-out")
    score = reward_function(cfg.data.reward, cfg.data.default.output_key)
    if cfg.data.overlong_prompts == "truncate":
        return TaskSource(lambda task: truncate_prompt(encode(task), max_prompt), eval_tasks, pool, score)
    return TaskSource(encode, eval_tasks, pool, score)


def rollout_reward(tokenizer, score: Callable[[str, Task], float], rollout) -> float:
    """A finished rollout's reward: its decoded response scored against the task it answers."""
    task = Task(rollout.prompt_id, rollout.meta["question"], rollout.meta["answer"])
    return score(decode_response(tokenizer, rollout.response_token_ids), task)
