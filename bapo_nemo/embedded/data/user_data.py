"""Your own data: prompts and reference answers from local Hugging Face `datasets` files, a held-out split,
prompts that do not fit the context window, and the math-verify reward.

`load_data(data_cfg, seed) -> (train tasks, held-out tasks)`. A source is a file (.parquet, .json, .jsonl,
.csv, .arrow) or a directory (`save_to_disk`, or data files of one kind: a mix is refused, `datasets`
would read only its most common kind). Malformed rows are skipped and counted; more than
`data.max_bad_fraction` of them is an error naming the file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import warnings
from collections.abc import Callable
from pathlib import Path

from bapo_nemo.embedded.data.tasks import Task, TaskFileError, answer_text, unscorable_answer
from bapo_nemo.embedded.data.text_checks import representation_problem
from bapo_nemo.embedded.output.run_log import LOGGER

log = logging.getLogger(LOGGER)

# file suffix -> `datasets` builder
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}


class DataError(TaskFileError):
    """A dataset is unusable; the message names the key or file and what to fix."""


# (prompt, answer, solution) of a row, as written -> what else makes it unusable (None: nothing)
RowProblem = Callable[[str, str, "str | None"], "str | None"]


def load_data(data_cfg, seed: int, row_problem: RowProblem | None = None) -> tuple[list[Task], list[Task]]:
    """Training and held-out tasks. Without `data.validation.data_path`, `data.eval_size` rows of the
    training source are held out (a seeded draw) and never trained on. `row_problem` says what else makes
    a row unusable (e.g. text the tokenizer cannot represent); such rows count as malformed."""
    train = load_tasks(data_cfg.train.data_path, data_cfg, data_cfg.train.split, "train.data_path", row_problem)
    if data_cfg.validation.data_path:
        held_out = load_tasks(data_cfg.validation.data_path, data_cfg, data_cfg.validation.split,
                              "validation.data_path", row_problem)
        return train, held_out
    problem = held_out_size_problem(train, data_cfg.eval_size, seed, data_cfg.train.data_path)
    if problem is not None:
        raise DataError(problem)
    return split_held_out(train, data_cfg.eval_size, seed)


def split_held_out(tasks: list[Task], eval_size: int, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, held-out): `eval_size` tasks drawn with `seed`; every prompt of the held-out set leaves the
    training set (duplicated prompts included), so held-out accuracy measures unseen prompts."""
    picked = random.Random(seed).sample(range(len(tasks)), min(eval_size, len(tasks)))
    held_out = [tasks[i] for i in sorted(picked)]
    questions = {t.question for t in held_out}
    return [t for t in tasks if t.question not in questions], held_out


def held_out_size_problem(tasks: list[Task], eval_size: int, seed: int, source: str) -> str | None:
    """Why holding `data.eval_size` rows out of `tasks` leaves nothing to train on, with a value that
    leaves enough (a fifth of the rows, checked with the run's own draw), or None."""
    if split_held_out(tasks, eval_size, seed)[0]:
        return None
    works = next((n for n in (len(tasks) // 5, len(tasks) // 10, 1) if n >= 1 and split_held_out(tasks, n, seed)[0]),
                 None)
    fix = (f"set data.eval_size={works} (a {'fifth' if works == len(tasks) // 5 else 'smaller share'} of them)"
           if works is not None else "its rows all share one prompt, so hold none out")
    return (f"data.eval_size={eval_size} holds out every prompt of data.train.data_path={source} ({len(tasks)} "
            f"usable rows; every copy of a held-out prompt leaves training), so none is left to train on: {fix}, "
            "or put held-out rows in a file of their own (data.validation.data_path)")


def load_tasks(path: str, data_cfg, split: str, key: str, row_problem: RowProblem | None = None) -> list[Task]:
    """Tasks from one source, fields mapped by `data_cfg`; `key` names the config key in messages."""
    rows = _read_rows(Path(path), split, key)
    columns = list(rows.column_names)
    data_cfg = _with_prompt_column(data_cfg, columns)
    fields = {"data.default.input_key": data_cfg.default.input_key,
              "data.default.output_key": data_cfg.default.output_key}
    if data_cfg.solution_field:
        fields["data.solution_field"] = data_cfg.solution_field
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
        problem = row_problem(prompt, answer, solution) if row_problem is not None else None
        if problem is not None:
            bad.append((index, problem))
            continue
        question = data_cfg.prompt_template.replace("{prompt}", prompt)
        tasks.append(Task(f"{stem}-{index}", question, answer, solution, {"row": index}))
    _report_bad_rows(path, bad, len(rows), data_cfg.max_bad_fraction)
    if not tasks:
        raise DataError(f"{path} holds no usable rows")
    return tasks


def _with_prompt_column(data_cfg, columns: list[str]):
    """`data.default.input_key` null: the source's `question` column, else TRL's `prompt`."""
    if data_cfg.default.input_key is not None:
        return data_cfg
    column = next((c for c in ("question", "prompt") if c in columns), "question or prompt")
    return data_cfg.model_copy(update={"default": data_cfg.default.model_copy(update={"input_key": column})})


def source_path_problem(path: str, key: str) -> str | None:
    """`data.<key>` names nothing on disk (known before anything is loaded), or None."""
    if Path(path).exists():
        return None
    return f"data.{key}: {path} does not exist (a .parquet/.json/.jsonl/.csv/.arrow file or a directory)"


def _read_rows(path: Path, split: str, key: str):
    import datasets

    datasets.disable_progress_bars()
    if (problem := source_path_problem(str(path), key)) is not None:
        raise DataError(problem)
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
                f"data.{key}: {path} has no split {split!r} (it has {list(loaded)}); "
                "set data.train.split / data.validation.split"
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
    prompt = row.get(data_cfg.default.input_key)
    if not isinstance(prompt, str) or not prompt.strip():
        return f"{data_cfg.default.input_key!r} is not a non-empty string"
    try:
        answer = answer_text(row.get(data_cfg.default.output_key))  # as written: 2 and 2.0 are "2"
    except ValueError as exc:
        return str(exc)
    if answer is None or not answer.strip():
        return f"{data_cfg.default.output_key!r} is empty or not a string/number"
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
            "columns with data.default.input_key / data.default.output_key, or raise data.max_bad_fraction."
        )
    warnings.warn(message, stacklevel=3)


def unrepresentable_rows(tokenizer) -> RowProblem:
    """A `row_problem` for `load_data`: the row's prompt, answer or solution does not survive the round trip
    through `tokenizer` (text_checks.py: the bundled character tokenizer turns letters into its unknown
    token; another class may drop them)."""

    def problem(prompt: str, answer: str, solution: str | None) -> str | None:
        for name, text in (("prompt", prompt), ("answer", answer), ("solution", solution or "")):
            if (why := representation_problem(tokenizer, text, name)) is not None:
                return why
        return None

    return problem


def template_problem(tokenizer, prompt_template: str) -> str | None:
    """`data.prompt_template`'s own text does not survive the round trip through `tokenizer`, or None."""
    why = representation_problem(tokenizer, prompt_template.replace("{prompt}", ""), "data.prompt_template")
    if why is None:
        return None
    return (f"{why}: use a model whose tokenizer knows them (policy.model_name), or a template without them "
            'such as "{prompt}"')


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
            "partial_rollouts.max_response_tokens): lower the latter, or set data.overlong_prompts=truncate"
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
