"""What a user can get wrong, run as the user runs it: `bapo-nemo ...` in a subprocess on real files.

Every case must end in one clear line naming the key or file and the fix, with a non-zero exit and no
traceback, and no case may destroy a run. The table lists each mistake with the exit code and the words
the message must contain; cases that need a trained run share one tiny run (copied before any damage).
Nothing is faked.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.tiny_run import TINY, bapo_nemo, copy_run, tree_digest, with_, write_config

REPO = Path(__file__).resolve().parents[2]

def start_training(cfg: Path, cwd: Path) -> cli_process.CliProcess | subprocess.Popen:
    """`bapo-nemo train CFG --output-dir out` in the background (the caller stops and reaps it)."""
    return cli_process.start("train", str(cfg), "--output-dir", "out", "--json", cwd=cwd, env=cli_process.cli_env())


def wait_while_running(proc: subprocess.Popen, ready, what: str) -> None:
    """Until ready() holds, for as long as the training runs: the test's next step needs that state, and
    a loaded machine only makes it come later (pytest's timeout bounds a hang)."""
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)


def jsonl(directory: Path, name: str, lines: list[bytes | str | dict]) -> Path:
    path = directory / name
    with path.open("wb") as fh:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            fh.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


GOOD_ROWS = [{"question": f"{a}+{b}?", "answer": str(a + b), "solution": f"{a}+{b}={a + b};#{a + b}"}
             for a in range(1, 10) for b in range(1, 4)]


# ---- the table: mistakes that end before any training ----------------------------------------------------
@dataclass
class Case:
    name: str
    setup: Callable[[Path], list[str]]  # writes files under tmp_path, returns the bapo-nemo arguments
    exit_code: int
    says: list[str]  # fragments the error output must contain
    skip: str | None = None
    extra_env: dict = field(default_factory=dict)


def _train(config: dict | None, *extra: str) -> Callable[[Path], list[str]]:
    def setup(tmp: Path) -> list[str]:
        return ["train", str(write_config(tmp, config)), "--output-dir", str(tmp / "out"), *extra]
    return setup


def _tasks_file(lines: list, **task) -> Callable[[Path], list[str]]:
    def setup(tmp: Path) -> list[str]:
        path = jsonl(tmp, "tasks.jsonl", lines)
        cfg = with_(task={"train_file": str(path), **task})
        return ["train", str(write_config(tmp, cfg)), "--output-dir", str(tmp / "out")]
    return setup


def _empty_config(tmp: Path) -> list[str]:
    (tmp / "empty.yaml").write_text("# nothing yet\n")
    return ["train", str(tmp / "empty.yaml"), "--output-dir", str(tmp / "out")]


def _bad_yaml(tmp: Path) -> list[str]:
    (tmp / "bad.yaml").write_text("model:\n  hidden_size: [32\n")
    return ["train", str(tmp / "bad.yaml"), "--output-dir", str(tmp / "out")]


_HELD_LOCKS: list = []


def _locked(tmp: Path) -> list[str]:
    from bapo_nemo.embedded.run.run_lock import OutputDirLock

    # this test process holds the lock, as a first `bapo-nemo train` would
    _HELD_LOCKS.append(OutputDirLock(tmp / "out").acquire())
    return ["train", str(write_config(tmp)), "--output-dir", str(tmp / "out")]


def _config_is_a_directory(tmp: Path) -> list[str]:
    return ["train", str(tmp), "--output-dir", str(tmp / "out")]


def _config_is_a_fifo(tmp: Path) -> list[str]:
    os.mkfifo(tmp / "tiny.yaml")  # e.g. a process substitution, <(...)
    return ["train", str(tmp / "tiny.yaml"), "--output-dir", str(tmp / "out")]


def _output_dir_is_a_file(tmp: Path) -> list[str]:
    (tmp / "out").write_text("my notes\n")
    return ["train", str(write_config(tmp)), "--output-dir", str(tmp / "out")]


def _data_config(tmp: Path, data_yaml: str) -> list[str]:
    """TINY plus a `data:` section written as YAML text, as a user would type it."""
    jsonl(tmp, "mine.jsonl", GOOD_ROWS)
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(TINY) + f"data:\n  train:\n    data_path: {tmp / 'mine.jsonl'}\n" + data_yaml)
    return ["train", str(tmp / "cfg.yaml"), "--output-dir", str(tmp / "out")]


def _own_model(vocab_size: int, with_tokenizer: bool) -> Callable[[Path], list[str]]:
    """A local `save_pretrained` model directory (the bundled character tokenizer beside it, or none)."""
    def setup(tmp: Path) -> list[str]:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from bapo_nemo.embedded.model.tokenizer import load_tokenizer

        config = Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96)
        Qwen2ForCausalLM(config).save_pretrained(tmp / "model")
        if with_tokenizer:
            load_tokenizer().save_pretrained(tmp / "model")
        cfg = with_(policy={"model_name": str(tmp / "model")})
        return ["train", str(write_config(tmp, cfg)), "--output-dir", str(tmp / "out")]
    return setup


def _mixed_data_dir(tmp: Path) -> list[str]:
    """12 JSONL rows and 60 CSV rows in one directory: `datasets` alone would read the JSONL only."""
    data = tmp / "data"
    data.mkdir()
    jsonl(data, "a.jsonl", GOOD_ROWS[:12])
    (data / "b.csv").write_text("question,answer\n" + "".join(f"{a}+{a}?,{2 * a}\n" for a in range(60)))
    cfg = with_(data={"train": {"data_path": str(data)}, "eval_size": 4})
    return ["train", str(write_config(tmp, cfg)), "--output-dir", str(tmp / "out")]


def _letters_in_data(tmp: Path) -> list[str]:
    """Word problems for the bundled character tokenizer, which knows digits and arithmetic signs only."""
    rows = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(1, 10) for b in range(1, 4)]
    cfg = with_(data={"train": {"data_path": str(jsonl(tmp, "words.jsonl", rows))}, "eval_size": 4})
    return ["train", str(write_config(tmp, cfg)), "--output-dir", str(tmp / "out")]


def _letters_in_small_data(tmp: Path) -> list[str]:
    """Ten word problems for the bundled tokenizer, with the default data.eval_size (64): two problems."""
    rows = [{"question": f"What is {a} plus 1?", "answer": str(a + 1)} for a in range(10)]
    cfg = with_(data={"train": {"data_path": str(jsonl(tmp, "words.jsonl", rows))}})
    return ["train", str(write_config(tmp, cfg)), "--output-dir", str(tmp / "out")]


def _missing_model_and_small_data(tmp: Path) -> list[str]:
    """A model directory that does not exist and ten rows with the default data.eval_size (64)."""
    rows = [{"question": f"{a}+1?", "answer": str(a + 1)} for a in range(10)]
    cfg = with_(policy={"model_name": "./own/tiny_model"},
                data={"train": {"data_path": str(jsonl(tmp, "mine.jsonl", rows))}})
    return ["train", str(write_config(tmp, cfg)), "--output-dir", str(tmp / "out")]


def _missing_model_dir(given: Callable[[Path], str]) -> Callable[[Path], list[str]]:
    """`policy.model_name` set to a path that does not exist, beside a saved model the user meant."""
    def setup(tmp: Path) -> list[str]:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=22, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96)
        Qwen2ForCausalLM(config).save_pretrained(tmp / "own" / "tiny-qwen2")
        return ["train", str(write_config(tmp, with_(policy={"model_name": given(tmp)}))), "--output-dir",
                str(tmp / "out")]
    return setup


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


LONG = "1+" * 150 + "1?"  # 302 characters: 303 tokens with BOS, on a 96-position model
CASES = [
    # already handled before this table existed; kept so they stay handled
    Case("unknown config key", _train(None, "optim.learning_rate=0.1"), 2, ["optim.learning_rate", "did you mean"]),
    Case("clip range empty", _train(None, "loss_fn.bapo.c_low_min=1.5"), 2, ["loss_fn.bapo"]),
    Case("rho0 out of range", _train(None, "loss_fn.bapo.rho0=1.5"), 2, ["rho0"]),
    Case("YAML syntax error", _bad_yaml, 2, ["bad.yaml", "not valid YAML"]),
    Case("JSONL >10% malformed rows", _tasks_file(GOOD_ROWS[:5] + ["{not json"] * 2), 2,
         ["tasks.jsonl", "line 6", "task.max_bad_fraction"]),
    # newly handled
    Case("empty config file", _empty_config, 2, ["empty.yaml is empty", "configs/local_cpu.yaml"]),
    Case("lr is .inf", _train(None, "policy.optimizer.kwargs.lr=.inf"), 2, ["policy.optimizer.kwargs.lr", "finite"]),
    Case("lr is .nan", _train(None, "policy.optimizer.kwargs.lr=.nan"), 2, ["policy.optimizer.kwargs.lr", "finite"]),
    Case("missing task.train_file", _train(with_(task={"train_file": "nowhere.jsonl"})), 2,
         ["nowhere.jsonl does not exist", "task.train_file"]),
    Case("tasks file with no tasks", _tasks_file([]), 2, ["holds no tasks"]),
    Case("invalid UTF-8 beyond max_bad_fraction", _tasks_file(GOOD_ROWS[:4] + [b'{"question": "1+1?\xff"}']), 2,
         ["line 5: invalid UTF-8", "task.max_bad_fraction"]),
    Case("prompts longer than the context", _tasks_file(GOOD_ROWS[:3] + [{"question": LONG, "answer": "151"}]),
         2, ["line 4: prompt of 303 tokens exceeds the 60"]),
    Case("1 MB prompt", _tasks_file([{"question": "1+" * 500_000 + "1?", "answer": "500001"}]), 2,
         ["line 1: prompt of 1000003 tokens"]),
    Case("cuda without CUDA", _train(None, "runtime.device=cuda"), 2, ["runtime.device=cuda", "runtime.device=cpu"],
         skip="this machine has CUDA" if _has_cuda() else None),
    Case("unreachable tracking server", _train(None, "logger.mlflow.tracking_uri=http://127.0.0.1:9"), 2,
         ["http://127.0.0.1:9", "Start the tracking server"]),
    Case("output dir in use", _locked, 2, ["is in use by PID", f"{os.getpid()}", "another --output-dir"]),
    Case("check --nodes 0", lambda tmp: ["check", str(REPO / "configs/bapo_7b.yaml"), "--nodes", "0",
                                         "--gpus-per-node", "8"], 2, ["--nodes: must be >= 1, got 0"]),
    # round 2 (each ended unclearly or trained on the wrong thing before)
    Case("config path is a directory", _config_is_a_directory, 2, ["is a directory", "pass a YAML file"]),
    Case("config path is a FIFO", _config_is_a_fifo, 2, ["tiny.yaml is not a regular file"]),
    Case("output dir is a file", _output_dir_is_a_file, 2, ["out is a file, not a directory"]),
    Case("prompt_template read as a mapping", lambda tmp: _data_config(tmp, "  prompt_template: {prompt}\n"), 2,
         ["data.prompt_template", "as a mapping", "quote it"]),
    Case("prompt_template without {prompt}", lambda tmp: _data_config(tmp, "  prompt_template: 'Solve:'\n"), 2,
         ["data.prompt_template", "has no {prompt}"]),
    Case("own model without a tokenizer", _own_model(22, with_tokenizer=False), 2,
         ["policy.model_name=", "encodes text as nothing", "tokenizer.save_pretrained"]),
    Case("tokenizer larger than the model's vocabulary", _own_model(10, with_tokenizer=True), 2,
         ["the tokenizer has 22 tokens but the model's embedding has 10 rows"]),
    Case("dataset directory mixing file types", _mixed_data_dir, 2,
         ["mixes kinds of data files", "a.jsonl", "b.csv", "set data.train.data_path to one file"]),
    Case("answers that can never score", _tasks_file(GOOD_ROWS[:5] + [{"question": "1+1?", "answer": "#2"},
                                                                      {"question": "1+2?", "answer": "3 "}]), 2,
         ["line 6: answer '#2' can never score", "line 7: answer '3 ' can never score", "task.max_bad_fraction"]),
    Case("text the bundled tokenizer cannot represent", _letters_in_data, 2,
         ["words.jsonl: skipped 27 malformed row(s) of 27", "prompt has characters the tokenizer cannot represent",
          "data.max_bad_fraction", "tokenizer that knows only these characters: '0123456789+-*=;#? '",
          "use a pretrained model with its own tokenizer, e.g. policy.model_name=smollm2-135m-instruct"]),
    # every start-up problem in the first message, each with a value that works
    Case("words in a small dataset: the alphabet and the held-out share together", _letters_in_small_data, 2,
         ["3 problems stop this run", "knows only these characters: '0123456789+-*=;#? '",
          "words.jsonl: skipped 10 malformed row(s) of 10",
          "data.eval_size=64 holds out every prompt", "set data.eval_size=2"]),
    Case("missing model directory and a small dataset together", _missing_model_and_small_data, 2,
         ["2 problems stop this run", "policy.model_name='./own/tiny_model': no such directory",
          "data.eval_size=64 holds out every prompt", "set data.eval_size=2"]),
    Case("no GPU beside a missing model directory and a small dataset: all three together",
         lambda tmp: [*_missing_model_and_small_data(tmp), "runtime.device=cuda"], 2,
         ["3 problems stop this run", "runtime.device=cuda but torch sees no CUDA GPU", "add runtime.device=cpu",
          "policy.model_name='./own/tiny_model': no such directory", "set data.eval_size=2"]),
    # a path that does not exist is a missing directory, whether written relative or absolute, never a hub id
    Case("own model directory that does not exist (relative)", _missing_model_dir(lambda tmp: "./own/tiny_model"), 2,
         ["policy.model_name='./own/tiny_model': no such directory", "own/tiny_model does not exist",
          "model directories in", "own: tiny-qwen2", "directory written by save_pretrained"]),
    Case("own model directory that does not exist (absolute)",
         _missing_model_dir(lambda tmp: str(tmp / "models" / "tiny_model")), 2,
         ["no such directory", "models/tiny_model does not exist", "or at a hub id such as"]),
    # answers read as written: 2.5 is "2.5" (a '.' the bundled tokenizer has not), 2.0 is 2
    Case("task file answers with a decimal point", _tasks_file(GOOD_ROWS[:5] + [{"question": "1+1?", "answer": 2.0},
                                                                           {"question": "2+2?", "answer": 2.5},
                                                                           {"question": "3+3?", "answer": 0.0001}]), 2,
         [("skipped 2 malformed row(s) of 8 (line 7: answer has characters outside the vocabulary: '.'; line 8: "
           "answer has characters outside the vocabulary: '.')")]),
    Case("responses longer than the bundled model's context", _train(None, "partial_rollouts.max_response_tokens=90"), 2,
         [("partial_rollouts.max_response_tokens=90 plus the longest prompt (~13 tokens) exceeds "
          "model.max_position_embeddings=96: set partial_rollouts.max_response_tokens=83 or lower, or set "
          "model.max_position_embeddings=103 or higher")]),
    Case("check --gpus-per-node -1", lambda tmp: ["check", str(REPO / "configs/bapo_7b.yaml"), "--nodes", "1",
                                                  "--gpus-per-node", "-1"], 2, ["--gpus-per-node: must be >= 1"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_mistake_ends_in_one_clear_line(case: Case, tmp_path):
    if case.skip:
        pytest.skip(case.skip)
    try:
        done = bapo_nemo(*case.setup(tmp_path), cwd=tmp_path, env=case.extra_env)
    finally:
        while _HELD_LOCKS:
            _HELD_LOCKS.pop().release()
    assert done.returncode == case.exit_code, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for fragment in case.says:
        assert fragment in done.stderr, f"{fragment!r} not in:\n{done.stderr[-3000:]}"
    assert not (tmp_path / "out" / "checkpoints").exists(), "a refused run must not write checkpoints"


def test_over_long_prompts_within_max_bad_fraction_are_skipped_and_counted(tmp_path):
    """One over-long prompt and one answer that can never score in 29 rows (6.9% <= 10%): the run trains on
    the other rows and says which lines it skipped and why."""
    rows = (GOOD_ROWS[:20] + [{"question": LONG, "answer": "151"}] + GOOD_ROWS[20:27]
            + [{"question": "2+2?", "answer": "#4", "solution": "2+2=4;#4"}])
    cfg = with_(task={"train_file": str(jsonl(tmp_path, "tasks.jsonl", rows))}, grpo={"max_num_steps": 1})
    done = bapo_nemo("train", str(write_config(tmp_path, cfg)), "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped 2 malformed row(s) of 29" in done.stderr and "line 21: prompt of 303 tokens" in done.stderr
    assert "line 29: answer '#4' can never score" in done.stderr
    skipped = [line for line in done.stderr.splitlines() if "skipped 2 malformed row(s)" in line]
    assert len(skipped) == 1 and skipped[0].startswith("warning: "), done.stderr[-3000:]
    assert "UserWarning" not in done.stderr and "warnings.warn" not in done.stderr


# ---- mistakes with a trained run: nothing of the run may be lost --------------------------------------------
@pytest.mark.parametrize("target", [".", "checkpoints", ".."])
def test_export_force_never_replaces_the_source_run(trained, tmp_path, target):
    run = copy_run(trained, tmp_path)
    before = tree_digest(run)
    out = (run / target).resolve()
    done = bapo_nemo("export", str(run), "--out", str(out), "--force", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "is or contains the checkpoint being exported" in done.stderr
    assert tree_digest(run) == before


def test_export_force_keeps_unrelated_files_and_replaces_a_previous_export(trained, tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    done = bapo_nemo("export", str(trained), "--out", str(mine), "--force", cwd=tmp_path)
    assert done.returncode == 2 and "not a previous bapo-nemo export" in done.stderr
    assert (mine / "thesis.tex").read_text() == "precious"

    out = tmp_path / "export"
    assert bapo_nemo("export", str(trained), "--out", str(out), cwd=tmp_path).returncode == 0
    again = bapo_nemo("export", str(trained), "--out", str(out), "--force", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "parity PASS" in again.stdout


def test_exported_model_answers_through_the_public_path(trained, tmp_path):
    """AutoTokenizer + AutoModelForCausalLM on the export (and on the run's hf_final) reproduce the trainer's
    prompt encoding and its greedy answer (the same ids the trainer feeds its model: BOS first, spaces kept)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bapo_nemo.embedded.loop.evaluation import encode_prompt
    from bapo_nemo.embedded.model.tokenizer import load_tokenizer

    out = tmp_path / "export"
    assert bapo_nemo("export", str(trained), "--out", str(out), cwd=tmp_path).returncode == 0
    source = AutoModelForCausalLM.from_pretrained(trained / "checkpoints" / "step_3" / "model")
    for directory, question in itertools.product([out, trained / "hf_final"], ["7+5-3?", "12 + 3?"]):
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory)
        ids = tokenizer(question, return_tensors="pt")
        assert ids["input_ids"][0].tolist() == encode_prompt(load_tokenizer(), question)
        plain = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        # the trainer's side: its final checkpoint's weights fed its own encoding
        trainer_ids = torch.tensor([encode_prompt(load_tokenizer(), question)])
        as_trained = source.generate(trainer_ids, attention_mask=torch.ones_like(trainer_ids), max_new_tokens=8,
                                    do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert plain.tolist() == as_trained.tolist()


def test_the_export_and_hf_final_say_how_to_prompt_them_and_hold_no_local_path(trained, tmp_path):
    """The card of the exported model (and of the run's hf_final) gives the prompt format and code that builds
    a prompt with the chat template saved beside the tokenizer, for a held-out question of the run; the
    export's card adds the model's greedy response, and that code, run as written with only the placeholder
    path replaced, prints exactly that response. The chat template gives the trainer's own prompt ids.
    Neither card nor bapo_training_info.json holds a path of this machine."""
    import re

    from transformers import AutoTokenizer

    from bapo_nemo.embedded.loop.evaluation import encode_prompt
    from bapo_nemo.embedded.model.tokenizer import load_tokenizer

    out = tmp_path / "export"
    done = bapo_nemo("export", str(trained), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    example = json.loads((trained / "checkpoints" / "step_3" / "training_info.json").read_text())["example"]
    assert re.fullmatch(r"[\d+-]+\?", example["question"]), example  # a held-out question of the bundled tasks
    for directory in (out, trained / "hf_final"):
        card = (directory / "README.md").read_text()
        assert "## How to prompt it" in card and f"a held-out question of the run: `{example['question']}`" in card
        code = card.split("```python\n", 1)[1].split("```", 1)[0]
        assert f'"content": "{example["question"]}"' in code
        printed = subprocess.run([sys.executable, "-c", code.replace("path/to/this/model", str(directory))],
                                 capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        assert printed.returncode == 0, printed.stderr[-2000:]
        if directory == out:
            [response] = re.findall(r"This model's greedy response at export: `(.*)`\.", card)
            assert printed.stdout.strip() == response
        tokenizer = AutoTokenizer.from_pretrained(directory)
        for question in (example["question"], "7+5-3?", "12 + 3?"):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                return_dict=True)["input_ids"]
            assert ids == encode_prompt(load_tokenizer(), question)
    texts = [(out / "README.md").read_text(), (out / "bapo_training_info.json").read_text(),
             (trained / "hf_final" / "README.md").read_text()]
    for local in (str(trained.parent), str(tmp_path), str(REPO), str(Path.home())):
        assert not any(local in text for text in texts), local
    assert "| checkpoint | `run/checkpoints/step_3` |" in texts[0]
    assert "| MLflow tracking URI | `sqlite:///<training run>/mlflow.db` |" in texts[0]


def test_weights_and_exports_respect_the_umask(trained, tmp_path):
    """Under umask 022 teammates can read everything (HF's atomic saves and mkdtemp default to 0600/0700).
    The checkpoint was written by the fixture's run under this process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    weights = trained / "checkpoints" / "step_3" / "model" / "model.safetensors"
    assert stat.S_IMODE(weights.stat().st_mode) == 0o666 & ~mask
    out = tmp_path / "export"
    done = subprocess.run(
        ["sh", "-c", f"umask 022 && {sys.executable} -m bapo_nemo.cli export {trained} --out {out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_report_defaults_beside_the_run_and_says_where(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    done = bapo_nemo("report", "--experiment", "bapo-embedded", "--tracking-uri", f"sqlite:///{run}/mlflow.db",
                     "--no-log", cwd=cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(cwd.iterdir()) == []
    assert (run / "report_bapo-embedded" / "report.html").is_file()
    assert f"wrote {run / 'report_bapo-embedded'}" in done.stdout


def test_check_prints_no_warning(tmp_path):
    done = bapo_nemo("check", str(REPO / "configs/bapo_7b.yaml"), "--nodes", "1", "--gpus-per-node", "8",
                     cwd=tmp_path, env={"PYTHONWARNINGS": "always"})
    assert done.returncode == 0, done.stdout[-2000:]
    assert "Warning" not in done.stderr and "deprecat" not in done.stderr.lower(), done.stderr


def test_second_run_into_a_locked_dir_refuses_and_the_first_is_untouched(tmp_path):
    """Two real `bapo-nemo train` processes into one --output-dir: the second exits 2 naming the first's
    PID; the first (stopped with SIGTERM afterwards) has one MLflow run and one metrics line per step."""
    cfg = write_config(tmp_path, with_(grpo={"max_num_steps": 500}))
    first = start_training(cfg, tmp_path)
    try:
        lock, metrics = tmp_path / "out" / ".lock", tmp_path / "out" / "metrics.jsonl"
        # the first run is mid-training, with steps logged, when the second arrives
        wait_while_running(first, lambda: metrics.is_file() and metrics.read_text().strip(), "its first step")
        assert lock.read_text().strip()
        second = bapo_nemo("train", str(cfg), "--output-dir", "out", "--resume", cwd=tmp_path)
        assert first.poll() is None, "the first run ended before the second started: the test proves nothing"
        first.send_signal(signal.SIGTERM)
        _, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, first_err[-3000:]  # stopped by SIGTERM after a checkpoint: 128 + 15
    assert second.returncode == 2 and f"PID {first.pid}" in second.stderr, second.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(len(steps))), steps
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bapo-embedded")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert lock.read_text() == ""  # released on exit


def test_stale_lock_of_a_dead_process_is_taken_over_and_reported(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    (run / ".lock").write_text(json.dumps({"pid": 999999, "host": "gone-node", "started": "yesterday"}))
    done = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run), "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by PID 999999 on host gone-node" in done.stderr


# ---- the trainer's own endings --------------------------------------------------------------------------------
def test_batch_run_logs_each_step_and_its_decisions(trained):
    """TINY runs with runtime.progress=false (as --no-progress): one line per step on stderr and in train.log."""
    stderr = (trained.parent / "stderr.txt").read_text()
    log = (trained / "train.log").read_text()
    for text in (stderr, log):
        assert "starting fresh" in text
        for step in (1, 2, 3):
            assert f"step {step}/3 reward " in text
        assert "finished at step 3" in text


def _mlflow_status(run: Path) -> str:
    from mlflow.tracking import MlflowClient

    run_id = (run / "mlflow_run_id").read_text().strip()
    return MlflowClient(f"sqlite:///{run / 'mlflow.db'}").get_run(run_id).info.status


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "model/model.safetensors"])
def test_resume_skips_a_truncated_newest_checkpoint(trained, tmp_path, damaged):
    run = copy_run(trained, tmp_path)
    target = run / "checkpoints" / "step_3" / damaged
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    done = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run), "--resume", "--max-steps", "4",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"skipping checkpoint step_3: {damaged} is truncated" in done.stderr, done.stderr[-3000:]
    assert "resuming from step 2" in done.stderr
    assert json.loads((run / "summary.json").read_text())["step"] == 4
    assert _mlflow_status(run) == "FINISHED"


def test_resume_with_no_intact_checkpoint_refuses_and_keeps_them(trained, tmp_path):
    run = copy_run(trained, tmp_path)
    for ckpt in (run / "checkpoints").glob("step_*"):
        state = ckpt / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:100])
    before = tree_digest(run / "checkpoints")
    done = bapo_nemo("train", str(write_config(tmp_path)), "--output-dir", str(run), "--resume", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "no intact checkpoint" in done.stderr and "step_3: trainer_state.pt is truncated" in done.stderr
    assert tree_digest(run / "checkpoints") == before


def test_ctrl_c_checkpoints_exits_130_and_a_resume_without_the_progress_bar_is_the_same_run(tmp_path):
    """Ctrl-C: the step finishes, a checkpoint is written, the MLflow run is KILLED and the exit status is 130
    (128 + SIGINT), so a script can tell the stop from a finished run. The run had its progress bar on; the
    resume is a batch job (--no-progress, and a larger --max-steps): the bar is a display setting, not a run
    parameter, so the resume names only the step count among changed params, and the params never held it."""
    from mlflow.tracking import MlflowClient

    cfg = write_config(tmp_path, with_(grpo={"max_num_steps": 500}, checkpointing={"save_period": 100},
                                       runtime={"progress": True}))
    proc = start_training(cfg, tmp_path)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        wait_while_running(proc, lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2,
                           "its first RL step")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "SIGINT" in stderr
    step = json.loads(stdout[stdout.index("{"):])["step"]
    assert 1 <= step < 500 and (tmp_path / "out" / "checkpoints" / f"step_{step}" / "COMPLETE").is_file()
    assert _mlflow_status(tmp_path / "out") == "KILLED"

    resumed = bapo_nemo("train", str(cfg), "--output-dir", "out", "--resume", "--no-progress", "--max-steps",
                        str(step + 1), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # --max-steps changes a run parameter (named, and kept as the run's tag); the bar's absence does not
    assert f"resuming from step {step}" in resumed.stderr and "runtime.progress" not in resumed.stderr
    assert "params changed since the run started (kept the old values): grpo.max_num_steps\n" in resumed.stderr
    run_id = (tmp_path / "out" / "mlflow_run_id").read_text().strip()
    run = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}").get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["bapo.params_changed_on_resume"] == "grpo.max_num_steps"
    assert "runtime.progress" not in run.data.params and run.data.params["runtime.num_threads"] == "1"


def test_a_run_that_fails_is_marked_failed(tmp_path):
    """A JSONL without solutions cannot be warmed up on: the run ends with one line, exit 1, status FAILED."""
    rows = [{"question": f"{a}+1?", "answer": str(a + 1)} for a in range(1, 10)]
    path = jsonl(tmp_path, "tasks.jsonl", rows)
    done = bapo_nemo("train", str(write_config(tmp_path, with_(task={"train_file": str(path)}))), "--output-dir",
                     "out", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "has no 'solution'" in done.stderr and "--debug" in done.stderr
    assert _mlflow_status(tmp_path / "out") == "FAILED"


def test_model_card_describes_the_tasks_the_run_trained_on(trained, tmp_path):
    """TINY generates 1 to 3 operations of `+`/`-` on operands 1 to 9 (the generator never writes `*`): the
    hf_final card and the export's card say exactly that, read from the run's config."""
    out = tmp_path / "export"
    assert bapo_nemo("export", str(trained), "--out", str(out), cwd=tmp_path).returncode == 0
    said = ("The questions were the bundled generated arithmetic tasks: 1 to 3 operations, each `+` or `-`, on "
            "single-digit operands 1 to 9, evaluated left to right with every intermediate value in 0 to 99, "
            "ending in `?` (e.g. `7+5-3?`); no `*`.")
    for card in (out / "README.md", trained / "hf_final" / "README.md"):
        text = card.read_text()
        assert said in text and "`+ - *`" not in text, text
