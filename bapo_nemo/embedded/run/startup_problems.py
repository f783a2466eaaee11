"""Every problem that stops a run before it starts, reported together, each with a value that works:
paths first (`check_paths`, before anything loads), then what needs the model and the data, gathered by
task_source.py into one StartupError.

    problems = Problems()
    with problems.gather(): rows = load_tasks(...)  # a DataError becomes one line; the next check runs
    problems.add(response_length_problem(...)); problems.raise_if_any()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from bapo_nemo.embedded.data.tasks import TaskFileError, task_file_problem
from bapo_nemo.embedded.data.user_data import DataError, source_path_problem
from bapo_nemo.embedded.model.bundled_model import bundled_problem, is_bundled
from bapo_nemo.embedded.model.policy import ModelLoadError, model_path_problem


class StartupError(DataError):
    """One or more problems of the config, one line each, each naming the key or file and the fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            super().__init__(f"{len(problems)} problems stop this run before it starts:\n  " + "\n  ".join(problems))


class Problems:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str | None) -> None:
        if line is not None:
            self.lines.append(line)

    @contextmanager
    def gather(self) -> Iterator[None]:
        """A user error raised in the block becomes a line (the block's result is then missing)."""
        try:
            yield
        except StartupError as exc:
            self.lines.extend(exc.problems)
        except (TaskFileError, ModelLoadError) as exc:
            self.lines.append(str(exc))

    def raise_if_any(self) -> None:
        if self.lines:
            raise StartupError(self.lines)


def check_paths(cfg) -> None:
    """Every path of the config that names nothing (the model directory, the dataset files, the task
    files), before anything is loaded. Raises StartupError."""
    problems = Problems()
    if is_bundled(cfg.policy.model_name):
        problems.add(bundled_problem(cfg.policy.model_name))
    elif cfg.policy.model_name is not None:
        problems.add(model_path_problem(cfg.policy.model_name))
    if cfg.data.train.data_path is not None:
        problems.add(source_path_problem(cfg.data.train.data_path, "train.data_path"))
        if cfg.data.validation.data_path:
            problems.add(source_path_problem(cfg.data.validation.data_path, "validation.data_path"))
    else:  # the task files are read only without a dataset
        for key in ("train_file", "eval_file"):
            if (path := getattr(cfg.task, key)) is not None:
                problems.add(task_file_problem(path, f"task.{key}"))
    problems.raise_if_any()


def response_length_problem(window: int, partial, train_lengths: list[int], held_out_lengths: list[int],
                            overlong: str) -> str | None:
    """Why `partial_rollouts.max_response_tokens` leaves the prompts no room in the model's context window
    of `window` tokens, with the value that fits them, or None. A problem when no prompt at all fits, or
    (overlong "skip") when every training or every held-out prompt is too long; a few too long are skipped
    with a warning (fit_prompts). `*_lengths`: the prompts' token counts, empty when unknown."""
    tokens = partial.max_response_tokens
    room = window - tokens
    lengths = sorted(train_lengths + held_out_lengths)
    every_set_has_one = all(not ls or min(ls) <= room for ls in (train_lengths, held_out_lengths))
    if room >= 1 and (overlong == "truncate" or every_set_has_one):
        return None
    said = (f"partial_rollouts.max_response_tokens={tokens} leaves "
            + ("no room for a prompt" if room < 1 else f"room for prompts of at most {room} tokens")
            + f" in the model's context window of {window} tokens")
    if not lengths:
        return f"{said}: set it below {window}, leaving room for your longest prompt"
    longest = lengths[-1]
    if window - longest >= 1:
        fits = window - longest
        fix = f"set partial_rollouts.max_response_tokens={fits} or lower (the longest prompt is {longest} tokens)"
    else:
        most = lengths[(len(lengths) * 9) // 10 - 1] if len(lengths) >= 10 else lengths[0]
        fits = window - most
        if fits < 1:
            return (f"{said}, and the prompts alone fill it (the shortest is {lengths[0]} tokens): shorten them, or "
                    "use a model with a longer context")
        skipped = sum(1 for n in lengths if n > most)
        fix = (f"set partial_rollouts.max_response_tokens={fits} or lower: the {skipped} prompts longer than {most} "
               f"tokens (of {len(lengths)}; the longest is {longest}) are then skipped, or cut from the left with "
               "data.overlong_prompts=truncate")
    if partial.token_budget >= fits:
        fix += (f"; partial_rollouts.token_budget={partial.token_budget} would then turn partial rollouts off "
                f"(they need it below max_response_tokens): e.g. partial_rollouts.token_budget={max(1, fits // 4)}")
    return f"{said}: {fix}"
