"""Verifiable reasoning tasks: multi-step arithmetic with heavy-tailed chain lengths.

A question lists operands and operators, evaluated left to right: `7+5-3?`. The reference solution is a
chain of steps then the final answer: `7+5=12;12-3=9;#9`. The reward checks the text after the last `#`
exactly. The number of operations is drawn from a truncated power law P(n) ~ n^-alpha, so most chains
are short and a few are long: the length mix partial rollouts are for.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy

from bapo_nemo.embedded.model.tokenizer import CHARACTERS

_ALLOWED = set(CHARACTERS)


@dataclass(frozen=True)
class Task:
    prompt_id: str
    question: str  # e.g. "7+5-3?"
    answer: str  # e.g. "9"
    solution: str | None = None  # e.g. "7+5=12;12-3=9;#9" (needed for the warm-up only)
    meta: dict = field(default_factory=dict, compare=False)


class TaskFileError(ValueError):
    """A JSONL task file is unusable; the message names the file and what to fix."""


def solve(
    operands: list[int], operators: list[str], error_rate: float = 0.0, rng: random.Random | None = None
) -> tuple[str, int]:
    """The left-to-right chain of steps and the final value. With `error_rate` > 0 each step's result is
    off by 1 or 2 with that probability and the chain carries on from the wrong value (imperfect
    demonstrations, like distilled SFT data: the warm-up imitates them and RL has errors to remove)."""
    value, steps = operands[0], []
    for op, x in zip(operators, operands[1:]):
        new = value + x if op == "+" else value - x if op == "-" else value * x
        if error_rate > 0 and rng is not None and rng.random() < error_rate:
            new = abs(new + rng.choice((-2, -1, 1, 2)))
        steps.append(f"{value}{op}{x}={new}")
        value = new
    return ";".join(steps) + f";#{value}", value


def looping_solution(chain: str, length: int, rng: random.Random) -> str:
    """A demonstration that gets stuck: the chain up to a random step, then that step repeated until
    `length` characters, with no final answer (the repetition loop that long chain-of-thought models fall
    into). Rollouts that imitate it run until they are cut off, score 0 and are much longer than correct
    answers: the length imbalance between negative and positive responses that BAPO corrects."""
    steps = chain.split(";")[:-1]  # drop "#answer"
    k = rng.randrange(len(steps))
    looped = ";".join(steps[: k + 1])
    while len(looped) < length:
        looped += ";" + steps[k]
    return looped[:length]


def heavy_tailed_weights(min_ops: int, max_ops: int, alpha: float) -> list[float]:
    return [n ** (-alpha) for n in range(min_ops, max_ops + 1)]


class TaskGenerator:
    """Seeded generator of arithmetic tasks; `state()`/`set_state()` make it resumable."""

    def __init__(
        self,
        seed: int,
        min_ops: int = 1,
        max_ops: int = 12,
        tail_alpha: float = 1.5,
        max_value: int = 99,
        max_operand: int = 9,
        prefix: str = "gen",
        step_error_rate: float = 0.0,
        loop_rate: float = 0.0,
        loop_length: int = 80,
    ):
        if not 1 <= min_ops <= max_ops:
            raise ValueError(
                f"task.min_ops={min_ops} and task.max_ops={max_ops} must satisfy 1 <= min <= max"
            )
        self.rng = random.Random(seed)
        self.min_ops, self.max_ops, self.max_value, self.max_operand = (
            min_ops,
            max_ops,
            max_value,
            max_operand,
        )
        self.weights = heavy_tailed_weights(min_ops, max_ops, tail_alpha)
        self.prefix, self.count = prefix, 0
        self.step_error_rate = step_error_rate
        self.loop_rate, self.loop_length = loop_rate, loop_length

    def sample_one(self) -> Task:
        rng = self.rng
        n_ops = rng.choices(range(self.min_ops, self.max_ops + 1), weights=self.weights)[0]
        value = rng.randint(1, self.max_operand)
        operands, operators = [value], []
        for _ in range(n_ops):
            x = rng.randint(1, self.max_operand)
            op = rng.choice("+-")
            # Keep every intermediate value in [0, max_value] so numbers stay short.
            if op == "+" and value + x > self.max_value:
                op = "-"
            elif op == "-" and value - x < 0:
                op = "+"
            value = value + x if op == "+" else value - x
            operands.append(x)
            operators.append(op)
        question = "".join(f"{a}{op}" for a, op in zip(operands, operators)) + f"{operands[-1]}?"
        _, result = solve(operands, operators)
        solution, _ = solve(operands, operators, self.step_error_rate, rng)
        meta = {"num_ops": n_ops}
        if self.loop_rate > 0 and rng.random() < self.loop_rate:
            solution = looping_solution(solution, self.loop_length, rng)
            meta["cut_off"] = True  # the demonstration stops at the length limit: no EOS after it
        self.count += 1
        return Task(f"{self.prefix}-{self.count}", question, str(result), solution, meta)

    def sample(self, n: int) -> list[Task]:
        return [self.sample_one() for _ in range(n)]

    def state(self) -> dict:
        return {"rng": self.rng.getstate(), "count": self.count}

    def set_state(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.count = state["count"]


def extract_answer(response: str) -> str | None:
    """The text after the last '#', or None when the response gives no final answer."""
    if "#" not in response:
        return None
    return response.rsplit("#", 1)[1].strip()


def reward(response: str, task: Task) -> float:
    """1.0 when the final answer matches exactly, else 0.0."""
    return 1.0 if extract_answer(response) == task.answer else 0.0


def unscorable_answer(answer: str) -> str | None:
    """Why `reward` can never give 1 for this reference answer, or None: it compares the text after the
    last '#' with the spaces around it removed, so an answer holding '#' or surrounded by spaces never
    matches."""
    if extract_answer("#" + answer) != answer:
        return (f"answer {answer!r} can never score: the reward compares the text after the last '#' with the "
                "surrounding spaces removed, so write the answer without '#' and without surrounding spaces")
    return None


# Floats hold every integer exactly only below this: a larger integral float may not be the number written.
_EXACT_INTEGERS = 2**53


def answer_text(value) -> str | None:
    """A reference answer as its file writes it: text as it is; an integer as its digits; an integral float as that integer (`2.0` is `2`, and so is `2` in a column that also holds
    `2.5`, which `datasets` reads as floats); another float in positional notation (`2.5`, `0.0001`). None:
    no answer (missing, empty, NaN or infinite, a bool). Raises ValueError for an integral float too large
    to be sure of its digits."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if value.is_integer():
            if abs(value) >= _EXACT_INTEGERS:
                raise ValueError(f"answer {value!r} was read as a float, too large to keep its digits: write it "
                                 'as a string ("12345678901234567890")')
            return str(int(value))
        return numpy.format_float_positional(value, trim="-")
    if isinstance(value, str):
        return value or None
    return None


def char_prompt_tokens(question: str) -> int:
    """Prompt length under the bundled tokenizer: BOS, then one token per character."""
    return 1 + len(question)


def load_jsonl_tasks(
    path: str | Path,
    max_bad_fraction: float = 0.1,
    max_prompt_tokens: int | None = None,
    prompt_tokens=char_prompt_tokens,
) -> list[Task]:
    """Tasks from a JSONL file, one object per line: {"question": "7+5-3?", "answer": "9"} plus optional
    "solution" (used by the warm-up) and "id". Malformed rows (not JSON, invalid UTF-8, missing fields,
    characters outside the vocabulary, a prompt longer than `max_prompt_tokens` as counted by
    `prompt_tokens`) are skipped and counted, with a warning naming the file and lines; more than
    `max_bad_fraction` of bad rows is an error."""
    path = Path(path)
    if (problem := task_file_problem(path, "task.train_file / task.eval_file")) is not None:
        raise TaskFileError(problem)
    tasks: list[Task] = []
    bad: list[tuple[int, str]] = []
    rows = 0
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            rows += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad.append((lineno, f"invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"))
                continue
            problem = _parse_row(line)
            if isinstance(problem, str):
                bad.append((lineno, problem))
                continue
            question, answer, solution, ident = problem
            if max_prompt_tokens is not None:
                length = prompt_tokens(question)
                if length > max_prompt_tokens:
                    why = (f"prompt of {length} tokens exceeds the {max_prompt_tokens} that "
                           "model.max_position_embeddings leaves after partial_rollouts.max_response_tokens")
                    bad.append((lineno, why))
                    continue
            tasks.append(Task(ident or f"{path.stem}-{lineno}", question, answer, solution, {"line": lineno}))
    if rows == 0:
        raise TaskFileError(
            f"{path} holds no tasks (empty file): write one JSON object per line, e.g. "
            '{"question": "7+5-3?", "answer": "9"}'
        )
    if bad:
        shown = "; ".join(f"line {n}: {why}" for n, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
        message = f"{path}: skipped {len(bad)} malformed row(s) of {rows} ({shown})"
        if len(bad) / rows > max_bad_fraction:
            raise TaskFileError(
                f"{message}; that is more than task.max_bad_fraction={max_bad_fraction}. Fix the rows "
                '(each line: {"question": "7+5-3?", "answer": "9"}, UTF-8, short enough for '
                "model.max_position_embeddings) or raise task.max_bad_fraction."
            )
        warnings.warn(message, stacklevel=2)
    if not tasks:
        raise TaskFileError(f"{path} holds no usable tasks")
    return tasks


def task_file_problem(path: str | Path, key: str) -> str | None:
    """The task file `key` names does not exist, or None."""
    if Path(path).is_file():
        return None
    return (f"{key}: task file {path} does not exist: set it to a JSONL file of rows such as "
            '{"question": "7+5-3?", "answer": "9"}, or to null for generated tasks')


def _parse_row(line: str):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg})"
    if not isinstance(row, dict):
        return "not a JSON object"
    question = row.get("question")
    if not isinstance(question, str) or not question:
        return "missing string 'question'"
    try:
        answer = answer_text(row.get("answer"))
    except ValueError as exc:
        return str(exc)
    if answer is None:
        return "missing 'answer'"
    solution = row.get("solution")
    if solution is not None and not isinstance(solution, str):
        return "'solution' is not a string"
    for name, text in (("question", question), ("answer", answer), ("solution", solution or "")):
        unknown = set(text) - _ALLOWED
        if unknown:
            return f"{name} has characters outside the vocabulary: {''.join(sorted(unknown))!r}"
    if unscorable_answer(answer):
        return unscorable_answer(answer)
    ident = row.get("id")
    return question, answer, solution, (str(ident) if ident is not None else None)


class TaskStream:
    """Training tasks in order: generated (seeded), or a JSONL pool reshuffled every epoch. Questions of
    the held-out set are never served, so held-out accuracy measures unseen problems."""

    def __init__(
        self,
        seed: int,
        task_cfg,
        exclude_questions: set[str] = frozenset(),
        pool: list[Task] | None = None,
        step_error_rate: float = 0.0,
        loop_rate: float = 0.0,
        loop_length: int = 80,
    ):
        self.exclude = set(exclude_questions)
        self.pool = [t for t in pool if t.question not in self.exclude] if pool is not None else None
        if self.pool is not None and not self.pool:
            raise TaskFileError(
                "every training task is also in the held-out set: use a different task.train_file"
            )
        self.generator = (
            None
            if pool is not None
            else TaskGenerator(
                seed,
                task_cfg.min_ops,
                task_cfg.max_ops,
                task_cfg.tail_alpha,
                task_cfg.max_value,
                task_cfg.max_operand,
                prefix=f"train{seed}",
                step_error_rate=step_error_rate,
                loop_rate=loop_rate,
                loop_length=loop_length,
            )
        )
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.position = 0
        self.served = 0

    def next(self, n: int) -> list[Task]:
        out = []
        while len(out) < n:
            if self.generator is not None:
                task = self.generator.sample_one()
                if task.question in self.exclude:
                    continue
            else:
                if self.position >= len(self.order):
                    self.order = list(range(len(self.pool)))
                    self.rng.shuffle(self.order)
                    self.position = 0
                base = self.pool[self.order[self.position]]
                self.position += 1
                task = Task(
                    f"{base.prompt_id}#{self.served}", base.question, base.answer, base.solution, base.meta
                )
            self.served += 1
            out.append(task)
        return out

    def state(self) -> dict:
        return {
            "generator": self.generator.state() if self.generator is not None else None,
            "rng": self.rng.getstate(),
            "order": self.order,
            "position": self.position,
            "served": self.served,
        }

    def set_state(self, state: dict) -> None:
        if self.generator is not None:
            self.generator.set_state(state["generator"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.position, self.served = list(state["order"]), state["position"], state["served"]
