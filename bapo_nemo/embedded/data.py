"""Your own data: prompts and reference answers from local Hugging Face `datasets` files, a held-out split,
prompts that do not fit the context window, and the math-verify reward.

    load_data(data_cfg, seed) -> (train tasks, held-out tasks)

A source is a file (.parquet, .json, .jsonl, .csv, .arrow) or a directory (written by
`Dataset.save_to_disk`, or holding data files of one of those kinds: a mix is refused, since `datasets`
would read only the most common kind; the files read are logged). `data.prompt_field` and
`data.answer_field` name the columns; `data.prompt_template` wraps each prompt ("{prompt}" is replaced).
Malformed rows (missing or empty fields, an answer the reward can never match, text the tokenizer cannot
represent) are skipped and counted with their row numbers; more than `data.max_bad_fraction` of them is an
error naming the file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import warnings
from collections.abc import Callable
from pathlib import Path

from bapo_nemo.embedded.run_log import LOGGER
from bapo_nemo.embedded.tasks import Task, TaskFileError, unscorable_answer

log = logging.getLogger(LOGGER)

# file suffix -> `datasets` builder
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}


class DataError(TaskFileError):
    """A dataset is unusable; the message names the key or file and what to fix."""


def load_data(data_cfg, seed: int, row_problem: Callable[[Task], str | None] | None = None
              ) -> tuple[list[Task], list[Task]]:
    """Training and held-out tasks. Without `data.eval_path`, `data.eval_size` rows of the training
    source are held out (a seeded draw) and never trained on. `row_problem(task)` says what else makes a
    row unusable (e.g. `unrepresentable_text`); such rows count as malformed."""
    train = load_tasks(data_cfg.train_path, data_cfg, data_cfg.split, "train_path", row_problem)
    if data_cfg.eval_path:
        held_out = load_tasks(data_cfg.eval_path, data_cfg, data_cfg.eval_split, "eval_path", row_problem)
        return train, held_out
    return split_held_out(train, data_cfg.eval_size, seed)


def split_held_out(tasks: list[Task], eval_size: int, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, held-out): `eval_size` tasks drawn with `seed`; every prompt of the held-out set leaves the
    training set (duplicated prompts included), so held-out accuracy measures unseen prompts."""
    if eval_size >= len(tasks):
        raise DataError(
            f"data.eval_size={eval_size} leaves no training rows (the source has {len(tasks)} usable rows): "
            "lower data.eval_size or set data.eval_path"
        )
    picked = random.Random(seed).sample(range(len(tasks)), eval_size)
    held_out = [tasks[i] for i in sorted(picked)]
    questions = {t.question for t in held_out}
    return [t for t in tasks if t.question not in questions], held_out


def load_tasks(path: str, data_cfg, split: str, key: str,
               row_problem: Callable[[Task], str | None] | None = None) -> list[Task]:
    """Tasks from one source, fields mapped by `data_cfg`; `key` names the config key in messages."""
    rows = _read_rows(Path(path), split, key)
    fields = {"data.prompt_field": data_cfg.prompt_field, "data.answer_field": data_cfg.answer_field}
    if data_cfg.solution_field:
        fields["data.solution_field"] = data_cfg.solution_field
    columns = list(rows.column_names)
    for name, column in fields.items():
        if column not in columns:
            raise DataError(
                f"{path}: no column {column!r} ({name}); its columns are {columns}. Set {name} to one of them."
            )
    stem = Path(path).name.split(".")[0]
    tasks, bad = [], []
    for index, row in enumerate(rows):
        problem = _check_row(row, data_cfg)
        if isinstance(problem, str):
            bad.append((index, problem))
            continue
        prompt, answer, solution = problem
        question = data_cfg.prompt_template.replace("{prompt}", prompt)
        task = Task(f"{stem}-{index}", question, answer, solution, {"row": index})
        problem = row_problem(task) if row_problem is not None else None
        if problem is not None:
            bad.append((index, problem))
            continue
        tasks.append(task)
    _report_bad_rows(path, bad, len(rows), data_cfg.max_bad_fraction)
    if not tasks:
        raise DataError(f"{path} holds no usable rows")
    return tasks


def _read_rows(path: Path, split: str, key: str):
    import datasets

    datasets.disable_progress_bars()
    if not path.exists():
        raise DataError(
            f"data.{key}: {path} does not exist (a .parquet/.json/.jsonl/.csv/.arrow file or a directory)"
        )
    try:
        if path.is_dir() and (
            (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
        ):
            loaded = datasets.load_from_disk(str(path))  # written by save_to_disk
        elif path.is_dir():
            _one_kind_of_data_files(path, key)
            loaded = datasets.load_dataset(str(path))
        elif path.suffix in BUILDERS:
            loaded = datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path))
        else:
            raise DataError(
                f"data.{key}: {path} has suffix {path.suffix!r}; use one of {', '.join(BUILDERS)} or a directory"
            )
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 (datasets raises many kinds; the message names the file)
        raise DataError(
            f"data.{key}: cannot read {path} with `datasets` ({type(exc).__name__}: {exc})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"data.{key}: {path} has no split {split!r} (it has {list(loaded)}); set data.split / data.eval_split"
            )
        loaded = loaded[split]
    return loaded


def _one_kind_of_data_files(path: Path, key: str) -> None:
    """A directory of data files must hold one kind (`datasets` reads only the most common kind and ignores
    the others without a word); the files read are logged."""
    kinds: dict[str, list[str]] = {}
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(path)
        if file.is_file() and file.suffix in BUILDERS and not any(part.startswith(".") for part in rel.parts):
            kinds.setdefault(BUILDERS[file.suffix], []).append(str(rel))
    if len(kinds) > 1:
        listing = "; ".join(f"{kind}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({len(names)} files)"
                            for kind, names in kinds.items())
        raise DataError(
            f"data.{key}: {path} mixes kinds of data files ({listing}), and only the most common kind would be "
            f"read: keep one kind in the directory, or set data.{key} to one file"
        )
    for names in kinds.values():
        log.info(f"data.{key}: reading {len(names)} file(s) from {path}: {', '.join(names[:10])}"
                 + (" ..." if len(names) > 10 else ""))


def _check_row(row: dict, data_cfg):
    """(prompt, answer, solution) or a string saying what is wrong with the row."""
    prompt, answer = row.get(data_cfg.prompt_field), row.get(data_cfg.answer_field)
    if not isinstance(prompt, str) or not prompt.strip():
        return f"{data_cfg.prompt_field!r} is not a non-empty string"
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        return f"{data_cfg.answer_field!r} is empty or not a string/number"
    if data_cfg.reward == "arithmetic" and unscorable_answer(answer.strip()):
        return unscorable_answer(answer.strip())
    solution = row.get(data_cfg.solution_field) if data_cfg.solution_field else None
    if data_cfg.solution_field and (not isinstance(solution, str) or not solution):
        return f"{data_cfg.solution_field!r} is not a non-empty string"
    return prompt, answer.strip(), solution


def _report_bad_rows(path, bad: list[tuple[int, str]], rows: int, max_bad_fraction: float) -> None:
    if not bad:
        return
    shown = "; ".join(f"row {n}: {why}" for n, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
    message = f"{path}: skipped {len(bad)} malformed row(s) of {rows} ({shown})"
    if len(bad) / max(rows, 1) > max_bad_fraction:
        raise DataError(
            f"{message}; that is more than data.max_bad_fraction={max_bad_fraction}. Fix the rows, map other "
            "columns with data.prompt_field / data.answer_field, or raise data.max_bad_fraction."
        )
    warnings.warn(message, stacklevel=3)


def unrepresentable_text(tokenizer, prompt_template: str) -> Callable[[Task], str | None]:
    """A `row_problem` for `load_data`: the row's prompt, answer or solution holds characters `tokenizer`
    cannot represent (they would become its unknown token: the bundled character tokenizer knows digits and
    arithmetic signs only). Raises DataError when the template itself holds some."""
    unk = tokenizer.unk_token_id

    def foreign(text: str) -> str:
        if unk is None or unk not in tokenizer.encode(text, add_special_tokens=False):
            return ""
        return "".join(sorted(c for c in set(text) if unk in tokenizer.encode(c, add_special_tokens=False)))

    in_template = foreign(prompt_template.replace("{prompt}", ""))
    if in_template:
        raise DataError(
            f"data.prompt_template has characters the tokenizer cannot represent ({in_template!r} would become "
            f"{tokenizer.unk_token}): use a model whose tokenizer knows them (model.pretrained), or a template "
            "without them"
        )

    def problem(task: Task) -> str | None:
        for name, text in (("prompt", task.question), ("answer", task.answer), ("solution", task.solution or "")):
            chars = foreign(text)
            if chars:
                return f"{name} has characters the tokenizer cannot represent: {chars!r}"
        return None

    return problem


# ---- prompts that do not fit ------------------------------------------------------------------------------
def fit_prompts(tasks: list[Task], encode, max_prompt_tokens: int, mode: str, what: str) -> list[Task]:
    """Tasks whose encoded prompt has at most `max_prompt_tokens` tokens. mode "skip" drops the others
    (counted, with their ids, in a warning); "truncate" keeps them all (`truncate_prompt` cuts them when
    encoded). Skipping every task is an error."""
    if mode == "truncate":
        return tasks
    fits = [len(encode(t)) <= max_prompt_tokens for t in tasks]
    kept = [t for t, ok in zip(tasks, fits) if ok]
    skipped = [t.prompt_id for t, ok in zip(tasks, fits) if not ok]
    if not kept:
        raise DataError(
            f"every {what} prompt is longer than {max_prompt_tokens} tokens (the context window minus "
            "rollout.partial.max_response_tokens): lower the latter, or set data.overlong_prompts=truncate"
        )
    if skipped:
        shown = ", ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else "")
        warnings.warn(
            f"skipped {len(skipped)} {what} prompt(s) of {len(tasks)} longer than {max_prompt_tokens} tokens "
            f"({shown}); data.overlong_prompts=truncate keeps them, cut from the left",
            stacklevel=2,
        )
    return kept


def truncate_prompt(ids: list[int], max_prompt_tokens: int) -> list[int]:
    """The last `max_prompt_tokens` tokens: the end of a prompt (the question, the chat template's
    assistant turn) is what the model must see to answer."""
    return ids[-max_prompt_tokens:] if len(ids) > max_prompt_tokens else ids


# ---- the math-verify reward -------------------------------------------------------------------------------
_VERIFY = None


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's answer equal to the reference, else 0.0; graded as NeMo-RL's
    math environment does (reference wrapped in \\boxed{}, LaTeX and plain expressions extracted from the
    response, any error or timeout scores 0)."""
    global _VERIFY
    from math_verify.errors import TimeoutException

    if _VERIFY is None:
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

        logging.getLogger("math_verify").setLevel(logging.CRITICAL)
        _VERIFY = math_metric(
            gold_extraction_target=(LatexExtractionConfig(),),
            pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
        )
    try:
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            score, _ = _VERIFY(["\\boxed{" + answer + "}"], [response])
        return float(score)
    except (Exception, TimeoutException):  # noqa: BLE001 (a response that breaks the grader scores 0)
        return 0.0
