"""Where a run's prompts, held-out tasks and rewards come from: your dataset when `data.train.data_path` is
set (prompts fitted to the context window, graded by `data.reward`), otherwise the bundled tasks
(generated arithmetic, or `task.*` JSONL files, graded by the bundled rule). Every problem found on the way
(a source that does not read, rows the tokenizer cannot represent, a held-out share that leaves nothing to
train on, responses too long for the context window) is reported together, each with a value that works
(startup_problems.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from bapo_nemo.embedded.config.run_config import RunConfig
from bapo_nemo.embedded.data.rewards import reward_function
from bapo_nemo.embedded.data.tasks import Task, TaskFileError, TaskGenerator, load_jsonl_tasks, reward
from bapo_nemo.embedded.data.text_checks import CANNOT_REPRESENT
from bapo_nemo.embedded.data.user_data import (
    fit_prompts,
    held_out_size_problem,
    load_tasks,
    source_path_problem,
    split_held_out,
    template_problem,
    truncate_prompt,
    unrepresentable_rows,
)
from bapo_nemo.embedded.loop.evaluation import decode_response, encode_prompt
from bapo_nemo.embedded.run.startup_problems import Problems, response_length_problem


class TaskSource(NamedTuple):
    encode: Callable[[Task], list[int]]  # task -> prompt token ids
    eval_tasks: list[Task]  # held out
    pool: list[Task] | None  # the training tasks; None: generated ones
    score: Callable[[str, Task], float]  # (response text, task) -> reward


def task_source(cfg: RunConfig, tokenizer, context_window: int) -> TaskSource:
    """The run's tasks; a prompt must leave `partial_rollouts.max_response_tokens` of the context window.
    Raises StartupError with every problem found."""

    def encode(task: Task) -> list[int]:
        return encode_prompt(tokenizer, task.question)

    if cfg.data.train.data_path is None:
        return _bundled_tasks(cfg, encode, context_window)
    return _dataset_tasks(cfg, tokenizer, encode, context_window)


def _bundled_tasks(cfg: RunConfig, encode, window: int) -> TaskSource:
    problems = Problems()
    max_prompt = window - cfg.partial_rollouts.max_response_tokens
    by_length = max_prompt if max_prompt >= 1 else None  # no room at all is said once, below
    eval_tasks, pool = [], None
    with problems.gather():
        eval_tasks = (
            load_jsonl_tasks(cfg.task.eval_file, cfg.task.max_bad_fraction, by_length)
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
    if cfg.task.train_file:
        with problems.gather():
            pool = load_jsonl_tasks(cfg.task.train_file, cfg.task.max_bad_fraction, by_length)
    # too long rows are malformed ones here (counted above): only a window with no room at all is left to say
    lengths = [len(encode(t)) for t in eval_tasks + (pool or [])]
    problems.add(response_length_problem(window, cfg.partial_rollouts, lengths, [], "truncate"))
    problems.raise_if_any()
    return TaskSource(encode, eval_tasks, pool, reward)


def _dataset_tasks(cfg: RunConfig, tokenizer, encode, window: int) -> TaskSource:
    data, problems = cfg.data, Problems()
    problems.add(template_problem(tokenizer, data.prompt_template))
    rows_problem = unrepresentable_rows(tokenizer)
    pool = eval_tasks = score = None
    with problems.gather():
        pool = load_tasks(data.train.data_path, data, data.train.split, "train.data_path", rows_problem)
    if data.validation.data_path:
        with problems.gather():
            eval_tasks = load_tasks(data.validation.data_path, data, data.validation.split, "validation.data_path",
                                    rows_problem)
    elif pool is not None:
        size_problem = held_out_size_problem(pool, data.eval_size, cfg.task.eval_seed, data.train.data_path)
        problems.add(size_problem)
        if size_problem is None:
            pool, eval_tasks = split_held_out(pool, data.eval_size, cfg.task.eval_seed)
    else:  # the rows' other problems still say whether data.eval_size leaves any to train on
        problems.add(_held_out_size_without_tokenizer(cfg))
    with problems.gather():
        score = reward_function(data.reward, data.default.output_key)
    problems.add(response_length_problem(window, cfg.partial_rollouts, [len(encode(t)) for t in pool or []],
                                         [len(encode(t)) for t in eval_tasks or []], data.overlong_prompts))
    if cfg.policy.model_name is None and any(CANNOT_REPRESENT in line for line in problems.lines):
        problems.lines.insert(0, _bundled_alphabet_line())
    problems.raise_if_any()
    max_prompt = window - cfg.partial_rollouts.max_response_tokens
    pool = fit_prompts(pool, encode, max_prompt, data.overlong_prompts, "training")
    eval_tasks = fit_prompts(eval_tasks, encode, max_prompt, data.overlong_prompts, "held-out")
    if data.overlong_prompts == "truncate":
        return TaskSource(lambda task: truncate_prompt(encode(task), max_prompt), eval_tasks, pool, score)
    return TaskSource(encode, eval_tasks, pool, score)


def _bundled_alphabet_line() -> str:
    """What the bundled tiny model can read, and what to use for other text."""
    from bapo_nemo.embedded.model.tokenizer import CHARACTERS

    return (f"the bundled tiny model (policy.model_name null) has a tokenizer that knows only these characters: "
            f"{''.join(CHARACTERS)!r} (the digits, + - * = ; # ? and space); for a dataset with other text (words, "
            "letters, LaTeX) use a pretrained model with its own tokenizer, e.g. "
            "policy.model_name=smollm2-135m-instruct (bundled, offline)")


def tokenizer_free_problems(cfg: RunConfig) -> list[str]:
    """What is wrong with the dataset as far as no tokenizer is needed to tell (it reads, its columns and
    rows, the held-out share, the reward): said beside a model that did not load, so that the first message
    holds every problem. Nothing when no dataset is configured or its path names nothing (said already)."""
    data, problems = cfg.data, Problems()
    if data.train.data_path is None or source_path_problem(data.train.data_path, "train.data_path"):
        return []
    pool = None
    with problems.gather():
        pool = load_tasks(data.train.data_path, data, data.train.split, "train.data_path")
    if data.validation.data_path:
        if not source_path_problem(data.validation.data_path, "validation.data_path"):
            with problems.gather():
                load_tasks(data.validation.data_path, data, data.validation.split, "validation.data_path")
    elif pool is not None:
        problems.add(held_out_size_problem(pool, data.eval_size, cfg.task.eval_seed, data.train.data_path))
    with problems.gather():
        reward_function(data.reward, data.default.output_key)
    return problems.lines


def _held_out_size_without_tokenizer(cfg: RunConfig) -> str | None:
    """`held_out_size_problem` for the rows that are well-formed whatever the tokenizer (the training rows
    failed with it): the fix for the tokenizer (another model) must not meet the held-out share next."""
    data = cfg.data
    try:
        rows = load_tasks(data.train.data_path, data, data.train.split, "train.data_path")
    except TaskFileError:
        return None  # said already, by the load with the tokenizer
    return held_out_size_problem(rows, data.eval_size, cfg.task.eval_seed, data.train.data_path)


def rollout_reward(tokenizer, score: Callable[[str, Task], float], rollout) -> float:
    """A finished rollout's reward: its decoded response scored against the task it answers."""
    task = Task(rollout.prompt_id, rollout.meta["question"], rollout.meta["answer"])
    return score(decode_response(tokenizer, rollout.response_token_ids), task)
