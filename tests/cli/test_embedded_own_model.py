"""Your own model and data on the embedded trainer: any HF causal LM (`policy.model_name`) and a local
Hugging Face `datasets` source (`data.*`), graded by math-verify. Nothing can be downloaded here, so each
test builds tiny random models of real families (Qwen2, Qwen3, Llama) from their configs, with a BPE
tokenizer trained on the spot, and saves them with `save_pretrained`: the trainer loads them exactly as it
loads a downloaded model. Nothing is faked; the `gpu` test runs the same path on CUDA."""

from __future__ import annotations

import json
import re
import shlex
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from bapo_nemo.embedded.config.run_config import load_config
from bapo_nemo.embedded.data.user_data import DataError, load_data, math_verify_reward
from bapo_nemo.embedded.loop.evaluation import encode_prompt
from bapo_nemo.embedded.run.startup_problems import StartupError
from bapo_nemo.embedded.run.task_source import task_source
from bapo_nemo.embedded.run.trainer import train
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is 3 + 4? The answer is \\boxed{7}.",
    "Compute 12 - 5. So the result is \\boxed{7}.",
    "Solve x + 2 = 5. Then x = \\boxed{3}.",
    "Half of one is \\frac{1}{2}, so \\boxed{\\frac{1}{2}}.",
] * 8


def make_tokenizer(chat_template: bool, pad: bool) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    core.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="<|im_end|>" if chat_template else "</s>",
        unk_token="<unk>",
        pad_token="<pad>" if pad else None,
    )
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    return tok


FAMILIES = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"chat_template": True, "pad": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"chat_template": True, "pad": False}),
    "llama": (LlamaConfig, LlamaForCausalLM, {"chat_template": False, "pad": False}),
}


def save_tiny_model(family: str, where: Path, window: int = 128, name: str | None = None) -> Path:
    config_cls, model_cls, tok_kwargs = FAMILIES[family]
    tok = make_tokenizer(**tok_kwargs)
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = where / (name or f"tiny-{family}")
    model_cls(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_dataset(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


MATH_ROWS = [
    {"problem": f"What is {a} + {b}?", "final": str(a + b)} for a in range(1, 9) for b in range(1, 5)
]


def run_config(tmp_path: Path, model_dir: Path, data_path: Path, *overrides: str):
    return load_config(
        None,
        [
            "runtime.progress=false",
            f"policy.model_name={model_dir}",
            f"data.train.data_path={data_path}",
            "data.default.input_key=problem",
            "data.default.output_key=final",
            "data.eval_size=4",
            "data.prompt_template={prompt} Put the answer in \\boxed{}.",
            "warmup.steps=0",
            "grpo.num_generations_per_prompt=2",
            "grpo.num_prompts_per_step=2",
            "partial_rollouts.token_budget=8",
            "partial_rollouts.max_resumptions=2",
            "partial_rollouts.max_response_tokens=16",
            "partial_rollouts.max_in_flight_groups=4",
            "grpo.max_num_steps=2",
            "policy.train_micro_batch_size=4",
            "grpo.val_period=2",
            "eval.k=1",
            "checkpointing.save_period=1",
            "tracking.samples_every=1",
            *overrides,
        ],
    )


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_trains_a_pretrained_model_of_each_family_on_a_parquet_dataset(tmp_path, family):
    model_dir = save_tiny_model(family, tmp_path)
    data = write_dataset(tmp_path / "math.parquet", MATH_ROWS)
    # A random model answers nothing correctly: all advantages are 0, so an entropy bonus gives the
    # update a gradient to show that the weights are trained.
    cfg = run_config(tmp_path, model_dir, data, "loss.entropy_coef=0.01")
    out = tmp_path / "run"
    summary = train(cfg, out)

    assert summary["step"] == 2
    assert summary["eval_end"]["step"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert r["train/policy_version"] > 0
    # the exported policy is the same family, loads with the Auto classes, and was trained (weights moved)
    final = AutoModelForCausalLM.from_pretrained(out / "hf_final")
    start = AutoModelForCausalLM.from_pretrained(model_dir)
    assert final.config.model_type == family
    moved = [not torch.equal(a, b) for a, b in zip(final.state_dict().values(), start.state_dict().values())]
    assert any(moved)
    tok = AutoTokenizer.from_pretrained(out / "hf_final")
    assert tok.pad_token_id is not None  # the pad token chosen for a tokenizer without one is saved with it
    info = json.loads((out / "checkpoints" / "step_2" / "training_info.json").read_text())
    assert info["model_name"] == str(model_dir)

    # the export says how it was prompted: its chat template builds the training prompt from a question (a
    # tokenizer without one gets one that puts the question in data.prompt_template; one with its own keeps
    # it, and the card's code puts the question in the template first), shown on a held-out question
    exported = tmp_path / "export"
    done = cli_process.run("export", str(out), "--out", str(exported), cwd=tmp_path, env=cli_process.cli_env(),
                           timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    card = (exported / "README.md").read_text()
    question = info["example"]["question"]
    a, b = re.fullmatch(r"What is (\d) \+ (\d)\?", question).groups()
    assert info["example"]["answer"] == str(int(a) + int(b))
    template = "{prompt} Put the answer in \\boxed{}."
    own_chat_template = FAMILIES[family][2]["chat_template"]
    content = template.replace("{prompt}", question) if own_chat_template else question
    assert f'"content": {json.dumps(content)}' in card and f"a held-out question of the run: `{question}`" in card
    assert str(tmp_path) not in card
    ids = AutoTokenizer.from_pretrained(exported).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == encode_prompt(AutoTokenizer.from_pretrained(model_dir), template.replace("{prompt}", question))


def test_bf16_autocast_and_gradient_checkpointing_on_cpu_and_resume(tmp_path):
    """The code path of `runtime.device=cuda` (autocast, checkpointing), on CPU, through a resume."""
    model_dir = save_tiny_model("qwen2", tmp_path)
    data = write_dataset(tmp_path / "math.parquet", MATH_ROWS)
    extra = ("policy.precision=bfloat16", "policy.dtensor_cfg.activation_checkpointing=true")
    out = tmp_path / "run"
    first = train(run_config(tmp_path, model_dir, data, *extra, "grpo.max_num_steps=1"), out)
    assert first["step"] == 1
    summary = train(run_config(tmp_path, model_dir, data, *extra, "grpo.max_num_steps=2"), out, resume=True)
    assert summary["step"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records[1:])


def test_chat_template_when_the_tokenizer_has_one_plain_prompt_otherwise(tmp_path):
    chat = make_tokenizer(chat_template=True, pad=True)
    ids = encode_prompt(chat, "What is 3 + 4?")
    assert chat.decode(ids) == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n"
    plain = make_tokenizer(chat_template=False, pad=True)
    ids = encode_prompt(plain, "What is 3 + 4?")
    assert ids[0] == plain.bos_token_id
    assert plain.decode(ids[1:]) == "What is 3 + 4?"


def test_math_verify_grades_like_the_cluster():
    assert math_verify_reward("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0  # equal values, different forms
    assert math_verify_reward("The answer is $\\boxed{x^2+1}$", "1+x^2") == 1.0
    assert math_verify_reward("\\boxed{13}", "12") == 0.0
    assert math_verify_reward("no answer here", "3") == 0.0
    assert math_verify_reward("\\boxed{\\frac{1}{", "3") == 0.0  # broken LaTeX scores 0, never raises


def test_dataset_rewards_go_through_math_verify_bundled_tasks_keep_the_arithmetic_reward(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path)
    data = write_dataset(tmp_path / "math.parquet", MATH_ROWS)
    cfg = run_config(tmp_path, model_dir, data)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    _, eval_tasks, pool, score = task_source(cfg, tok, 128)
    task = next(t for t in pool if t.answer == "7")
    assert task.question.endswith("Put the answer in \\boxed{}.")
    assert score("3 + 4 = \\boxed{7}", task) == 1.0
    assert score("#7", task) == 0.0  # the arithmetic reward's format is not an answer here
    assert {t.question for t in eval_tasks}.isdisjoint(t.question for t in pool)
    assert len(eval_tasks) == 4 and len(pool) == len(MATH_ROWS) - 4

    bundled = load_config(None, ["runtime.progress=false"])
    _, _, _, arithmetic = task_source(bundled, tok, 256)
    from bapo_nemo.embedded.data.tasks import Task

    assert arithmetic("7+5=12;#12", Task("t", "7+5?", "12")) == 1.0
    assert arithmetic("\\boxed{12}", Task("t", "7+5?", "12")) == 0.0


def test_malformed_rows_are_counted_with_their_row_numbers(tmp_path):
    rows = MATH_ROWS[:18] + [{"problem": "", "final": "3"}, {"problem": "What is 1 + 1?", "final": None}]
    data = write_dataset(tmp_path / "math.parquet", rows)
    cfg = run_config(tmp_path, tmp_path, data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_tasks, held_out = load_data(cfg.data, seed=0)
    message = " ".join(str(w.message) for w in caught)
    assert "skipped 2 malformed row(s) of 20" in message
    assert "row 18:" in message and "row 19:" in message
    assert len(train_tasks) + len(held_out) == 18

    strict = load_config(
        None,
        [
            f"data.train.data_path={data}",
            "data.default.input_key=problem",
            "data.default.output_key=final",
            "data.max_bad_fraction=0.05",
        ],
    )
    with pytest.raises(DataError, match="data.max_bad_fraction=0.05"):
        load_data(strict.data, seed=0)


def test_dataset_formats_jsonl_and_save_to_disk_directory(tmp_path):
    import datasets

    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in MATH_ROWS))
    disk = tmp_path / "held_out"
    datasets.Dataset.from_list(MATH_ROWS[:5]).save_to_disk(str(disk))
    cfg = load_config(
        None,
        [
            f"data.train.data_path={jsonl}",
            f"data.validation.data_path={disk}",
            "data.default.input_key=problem",
            "data.default.output_key=final",
        ],
    )
    train_tasks, held_out = load_data(cfg.data, seed=0)
    assert len(train_tasks) == len(MATH_ROWS) and len(held_out) == 5
    assert held_out[0].question == "What is 1 + 1?" and held_out[0].answer == "2"


def test_bad_input_names_the_key_or_file(tmp_path):
    data = write_dataset(tmp_path / "math.parquet", MATH_ROWS)
    # a dataset without the mapped field
    cfg = load_config(None, [f"data.train.data_path={data}", "data.default.output_key=final"])
    with pytest.raises(DataError, match=r"no column 'question or prompt' \(data.default.input_key\).*'problem'"):
        load_data(cfg.data, seed=0)
    # a missing file, an unknown format
    cfg = load_config(None, [f"data.train.data_path={tmp_path / 'nope.parquet'}"])
    with pytest.raises(DataError, match="data.train.data_path.*does not exist"):
        load_data(cfg.data, seed=0)
    (tmp_path / "rows.txt").write_text("x")
    cfg = load_config(None, [f"data.train.data_path={tmp_path / 'rows.txt'}"])
    with pytest.raises(DataError, match="suffix '.txt'"):
        load_data(cfg.data, seed=0)
    # a directory that is not a model
    (tmp_path / "not_a_model").mkdir()
    cfg = run_config(tmp_path, tmp_path / "not_a_model", data)
    with pytest.raises(StartupError, match="policy.model_name=.*not a model directory"):
        train(cfg, tmp_path / "run")


def test_overlong_prompts_are_skipped_and_counted_or_truncated(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path)
    rows = MATH_ROWS + [{"problem": "What is " + " + ".join(["1"] * 60) + "?", "final": "60"}]
    data = write_dataset(tmp_path / "math.parquet", rows)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    window = 64  # max_response_tokens=16 leaves 48 prompt tokens: the long row needs more
    cfg = run_config(tmp_path, model_dir, data, "data.validation.data_path=" + str(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encode, eval_tasks, pool, _ = task_source(cfg, tok, window)
    assert len(pool) == len(MATH_ROWS) and len(eval_tasks) == len(MATH_ROWS)
    assert any(
        "skipped 1 training prompt(s)" in str(w.message) and "math-32" in str(w.message) for w in caught
    )

    cfg = run_config(
        tmp_path, model_dir, data, "data.validation.data_path=" + str(data), "data.overlong_prompts=truncate"
    )
    encode, eval_tasks, pool, _ = task_source(cfg, tok, window)
    long = next(t for t in pool if t.answer == "60")
    full = encode_prompt(tok, long.question)
    assert len(full) > 48
    assert encode(long) == full[-48:]  # the end of the prompt (the question's ask) is kept


@pytest.mark.gpu
def test_cuda_bf16_autocast_gradient_checkpointing_end_to_end(tmp_path):
    """The same run as on CPU, on one GPU: sampling, the BAPO update and the checkpoint all on CUDA."""
    model_dir = save_tiny_model("qwen3", tmp_path)
    data = write_dataset(tmp_path / "math.parquet", MATH_ROWS)
    cfg = run_config(
        tmp_path,
        model_dir,
        data,
        "runtime.device=cuda",
        "policy.precision=bfloat16",
        "policy.dtensor_cfg.activation_checkpointing=true",
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records[1:])
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_final")
    assert final.config.model_type == "qwen3"


def test_prepare_model_bf16_autocast_and_gradient_checkpointing(tmp_path):
    """Autocast makes the forward's matmuls bf16 (weights stay fp32); checkpointing is switched on; both
    are applied again to a copy loaded from disk (as on resume)."""
    from bapo_nemo.embedded.model.policy import prepare_model

    model_dir = save_tiny_model("qwen2", tmp_path)
    ids = torch.tensor([[1, 5, 7, 9]])
    plain = prepare_model(
        AutoModelForCausalLM.from_pretrained(model_dir), torch.device("cpu"), "float32", "float32", False
    )
    assert plain(input_ids=ids).logits.dtype == torch.float32
    assert not plain.is_gradient_checkpointing
    fast = prepare_model(
        AutoModelForCausalLM.from_pretrained(model_dir), torch.device("cpu"), "float32", "bfloat16", True
    )
    assert fast(input_ids=ids).logits.dtype == torch.bfloat16
    assert next(fast.parameters()).dtype == torch.float32
    assert fast.is_gradient_checkpointing
    # close to the fp32 logits (bf16 has ~3 significant digits)
    torch.testing.assert_close(
        fast(input_ids=ids).logits.float(), plain(input_ids=ids).logits, atol=5e-2, rtol=5e-2
    )


def readme_own_model_command() -> list[str]:
    """The README's own-model command (the CPU one), as written."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = text.split("## Your own model and data", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    [line] = [x for x in block.replace("\\\n", " ").splitlines() if x.startswith("bapo-nemo train")]
    return shlex.split(line)


def test_the_readme_own_model_command_runs_as_written_on_a_cpu(tmp_path):
    """The README's own-model command, run as written (a CLI subprocess) in a directory holding
    my_math.jsonl, on this CPU machine. Only the bundled SmolLM2 is swapped for a tiny local model (its
    135M parameters cost more than a test may) and settings that make it one short step are appended. Its GPU variant (the same without the
    CPU settings) stops at once naming both settings; with runtime.device=cpu alone it says bf16 autocast
    runs on the CPU."""
    import subprocess
    import sys

    readme = readme_own_model_command()
    assert readme[:3] == ["bapo-nemo", "train", "configs/own_model.yaml"]
    assert "policy.model_name=smollm2-135m-instruct" in readme and "--output-dir" not in readme
    cpu_settings = readme[-2:]
    assert cpu_settings == ["runtime.device=cpu", "policy.precision=float32"]
    model_dir = save_tiny_model("qwen2", tmp_path)
    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[2] / "configs")
    (tmp_path / "my_math.jsonl").write_text(
        "".join(json.dumps({"question": r["problem"], "answer": r["final"]}) + "\n" for r in MATH_ROWS)
    )
    command = [sys.executable, "-m", "bapo_nemo.cli", *readme[1:]]
    command[command.index("policy.model_name=smollm2-135m-instruct")] = f"policy.model_name={model_dir}"
    one_step = [
        "data.eval_size=4",
        "grpo.num_generations_per_prompt=2",
        "grpo.num_prompts_per_step=2",
        "partial_rollouts.token_budget=8",
        "partial_rollouts.max_response_tokens=16",
        "partial_rollouts.max_in_flight_groups=4",
        "grpo.max_num_steps=1",
        "eval.k=1",
        "--no-progress",
    ]

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)

    done = run(*command, *one_step)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "runs" / "own_model" / "summary.json").read_text())["step"] == 1
    assert (tmp_path / "runs" / "own_model" / "hf_final" / "COMPLETE").is_file()
    assert "bf16 autocast" not in done.stderr
    # own_model.yaml has no warm-up: the first held-out score is the model's as loaded
    assert "held-out avg@1: " in done.stdout and " at the start (no warm-up) -> " in done.stdout
    assert "warm-up" not in done.stdout.replace("(no warm-up)", ""), done.stdout

    gpu = [a for a in command if a not in cpu_settings]
    if not torch.cuda.is_available():
        no_gpu = run(*gpu, *one_step)
        assert no_gpu.returncode == 2
        [line] = no_gpu.stderr.strip().splitlines()
        assert line.startswith("error: runtime.device=cuda")
        assert line.endswith("add runtime.device=cpu policy.precision=float32")

    (tmp_path / "empty").mkdir()
    bad = run(*gpu, "runtime.device=cpu", f"policy.model_name={tmp_path / 'empty'}", *one_step,
              "--output-dir", "runs/bad")
    assert bad.returncode == 2
    assert bad.stderr.startswith("note: policy.precision=bfloat16 on CPU: every forward runs under bf16")
    assert bad.stderr.strip().splitlines()[-1].startswith("error: policy.model_name=")
    assert "not a model directory" in bad.stderr


def test_the_readme_own_model_command_on_a_small_dataset_names_every_problem_at_once_with_values_that_work(
        tmp_path):
    """The README's own-model command on 30 rows and a local model with a 256-token window: own_model.yaml
    holds 64 rows out and allows 1024-token responses, so it cannot start. Both problems come in one
    message, each with a value that works (a fifth of the rows held out; the window minus the longest
    prompt, computed here with transformers' own chat template), and the same command with exactly those
    values appended then trains. Paths that name nothing are said together too, before anything loads."""
    readme = readme_own_model_command()
    model_dir = save_tiny_model("qwen2", tmp_path, window=256, name="tiny_model")
    (tmp_path / "configs").symlink_to(Path(__file__).resolve().parents[2] / "configs")
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(1, 7) for b in range(1, 6)]
    (tmp_path / "my_math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    command = [*readme[1:], "--no-progress"]
    command[command.index("policy.model_name=smollm2-135m-instruct")] = f"policy.model_name={model_dir}"

    def run(*argv: str):
        return cli_process.run(*argv, cwd=tmp_path, env=cli_process.cli_env(), timeout=HANG_GUARD_S)

    refused = run(*command)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "error: 2 problems stop this run before it starts:" in refused.stderr
    tok = AutoTokenizer.from_pretrained(model_dir)
    template = yaml.safe_load((tmp_path / "configs" / "own_model.yaml").read_text())["data"]["prompt_template"]
    longest = max(len(tok.apply_chat_template([{"role": "user", "content": template.replace("{prompt}", r["question"])}],
                                              tokenize=True, add_generation_prompt=True)["input_ids"]) for r in rows)
    fits = 256 - longest
    assert ("data.eval_size=64 holds out every prompt of data.train.data_path=my_math.jsonl (30 usable rows"
            in refused.stderr and "set data.eval_size=6 (a fifth of them)" in refused.stderr)
    assert (f"partial_rollouts.max_response_tokens=1024 leaves no room for a prompt in the model's context window "
            f"of 256 tokens: set partial_rollouts.max_response_tokens={fits} or lower (the longest prompt is "
            f"{longest} tokens); partial_rollouts.token_budget=256 would then turn partial rollouts off") in refused.stderr
    assert not (tmp_path / "runs" / "own_model" / "checkpoints").exists()

    suggested = re.findall(r"set (\S+=\d+)|e\.g\. (\S+=\d+)", refused.stderr)
    fixes = [a or b for a, b in suggested]
    assert fixes == ["data.eval_size=6", f"partial_rollouts.max_response_tokens={fits}",
                     f"partial_rollouts.token_budget={fits // 4}"]
    one_short_step = ["grpo.num_generations_per_prompt=2", "grpo.num_prompts_per_step=2",
                      "partial_rollouts.max_in_flight_groups=4", "grpo.max_num_steps=1", "eval.k=1"]
    done = run(*command, *fixes, *one_short_step)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "own_model" / "summary.json").read_text())
    assert summary["step"] == 1 and summary["eval_end"]["step"] == 1

    # nothing loads while a path names nothing: the missing model directory and dataset are said together
    missing = run(*command, "policy.model_name=./own/tiny_model", "data.train.data_path=my_maths.jsonl",
                  "--output-dir", "runs/typo")
    assert missing.returncode == 2, missing.stderr[-3000:]
    assert "error: 2 problems stop this run before it starts:" in missing.stderr
    assert f"policy.model_name='./own/tiny_model': no such directory ({tmp_path}/own/tiny_model does not exist" \
        in missing.stderr
    assert "data.train.data_path: my_maths.jsonl does not exist" in missing.stderr


def save_bundled_tokenizer_model(where: Path) -> Path:
    """A Qwen2 model saved with the bundled character tokenizer beside it, as a user would make one: its
    config.json says qwen2, so transformers 5 loads that tokenizer as Qwen2Tokenizer, which drops letters
    and spaces instead of mapping them to <unk>."""
    from bapo_nemo.embedded.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(where / "char-qwen2")
    tokenizer.save_pretrained(where / "char-qwen2")
    return where / "char-qwen2"


def test_text_the_loaded_tokenizer_drops_is_refused_by_round_trip_whatever_its_class(tmp_path):
    """Word problems and an English template with the bundled vocabulary reloaded as Qwen2Tokenizer: the
    letters are not turned into <unk> but dropped (`What is 1 plus 1?` comes back as `11?`), so looking for
    <unk> saw nothing and the run trained on digits alone. The round trip catches both the rows (skipped and
    counted, here all of them) and the template, in one message; rows of digits and signs with the same
    model train."""
    model_dir = save_bundled_tokenizer_model(tmp_path)
    assert type(AutoTokenizer.from_pretrained(model_dir)).__name__ == "Qwen2Tokenizer"  # the premise
    words = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(1, 10) for b in range(1, 4)]
    (tmp_path / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in words))
    settings = [f"policy.model_name={model_dir}", "data.eval_size=4", "warmup.steps=0", "grpo.max_num_steps=1",
                "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "eval.k=1",
                "partial_rollouts.token_budget=8", "partial_rollouts.max_response_tokens=16",
                "partial_rollouts.max_in_flight_groups=4", "--no-progress"]
    refused = cli_process.run("train", str(REPO / "configs" / "local_cpu.yaml"), "data.train.data_path=words.jsonl",
                              "data.prompt_template=Question {prompt}", *settings, "--output-dir", "words",
                              cwd=tmp_path, env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "2 problems stop this run before it starts" in refused.stderr
    assert ("data.prompt_template has characters the tokenizer cannot represent: ' Qeinostu' ('Question ' comes "
            "back from Qwen2Tokenizer as '')") in refused.stderr
    assert ("words.jsonl: skipped 27 malformed row(s) of 27 (row 0: prompt has characters the tokenizer cannot "
            "represent: ' Wahilpstu' ('What is 1 plus 1?' comes back from Qwen2Tokenizer as '11?')") in refused.stderr

    sums = [{"question": f"{a}+{b}?", "answer": str(a + b)} for a in range(1, 10) for b in range(1, 4)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums))
    done = cli_process.run("train", str(REPO / "configs" / "local_cpu.yaml"), "data.train.data_path=sums.jsonl",
                           *settings, "--output-dir", "sums", cwd=tmp_path, env=cli_process.cli_env(),
                           timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "malformed" not in done.stderr


def test_numbers_as_answers_are_read_as_written(tmp_path):
    """A JSONL whose answers mix 2 and 2.0 (`datasets` reads that column as floats, so every answer came back
    as "2.0" and a '.' the bundled tokenizer has not: the file was refused whole): each answer is read as
    written, an integral float as that integer; a real decimal (2.5) keeps its point and is the one row
    skipped. The answers the run trains on are the integers, as its logged sample table shows."""
    from mlflow.tracking import MlflowClient

    rows = [{"question": f"{a}+{b}?", "answer": (a + b) if a % 2 else float(a + b)}
            for a in range(1, 9) for b in range(1, 3)] + [{"question": "5-2?", "answer": 2.5}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert '"answer": 3.0' in (tmp_path / "mixed.jsonl").read_text()  # the premise: integral floats as written
    done = cli_process.run(
        "train", str(REPO / "configs" / "local_cpu.yaml"), "data.train.data_path=mixed.jsonl", "data.eval_size=2",
        "data.reward=arithmetic", "warmup.steps=0", "grpo.max_num_steps=1", "grpo.num_prompts_per_step=8",
        "grpo.num_generations_per_prompt=2", "eval.k=1", "partial_rollouts.max_in_flight_groups=8",
        "tracking.samples_every=1", "tracking.num_samples=8", "--no-progress", "--output-dir", "run",
        cwd=tmp_path, env=cli_process.cli_env(), timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("mixed.jsonl: skipped 1 malformed row(s) of 17 (row 16: answer has characters the tokenizer cannot "
            "represent: '.' ('2.5' comes back from") in done.stderr
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
    client = MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    table = json.loads(Path(client.download_artifacts(run_id, "samples/step_000001.json", str(tmp_path))).read_text())
    samples = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert len(samples) == 8
    for sample in samples:
        a, b = sample["prompt"].rstrip("?").split("+")
        assert sample["answer"] == str(int(a) + int(b))


REWARD_MODULE = '''
import json

def digits(prompts, completions, answer, **kwargs):
    """A reward of one's own, as TRL's reward_funcs are written: one reward per completion."""
    with open("calls.jsonl", "a") as log:
        log.write(json.dumps({"prompts": prompts, "completions": completions, "answer": answer,
                              "other": sorted(kwargs)}) + "\\n")
    return [len(a) / 10 for a in answer]
'''


def save_eos_model(where: Path) -> Path:
    """A tiny Qwen2 whose first sampled token is EOS whatever the prompt, so every response finishes and
    is scored. By construction: the layers add nothing to the residual stream (output projections zero),
    every embedding has 1 in dimension 0, the final norm keeps dimension 0 alone, and the tied EOS
    embedding has 11 there: the EOS logit is 11x every other one (about 60 against 5.6)."""
    model_dir = save_tiny_model("qwen2", where)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = model.model.embed_tokens.weight
        embeddings[:, 0] = 1.0
        embeddings[eos, 0] = 11.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    model.save_pretrained(model_dir)
    return model_dir


def test_a_reward_of_ones_own_named_module_function_grades_the_run(tmp_path):
    """`data.reward=my_rewards:digits` (a module beside the user, written here) grades a run started as a user
    starts it, on a dataset with TRL's `prompt` column and no column setting. The function is called as TRL
    calls reward_funcs (prompts, completions, the answer column by name, one completion per call), and the
    step's reward/mean is the mean of what it returned for the step's groups."""

    model_dir = save_eos_model(tmp_path)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in (1, 7, 40, 95) for b in (2, 5)]
    (tmp_path / "trl_style.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    repo = Path(__file__).resolve().parents[2]
    done = cli_process.run(
        "train", str(repo / "configs" / "own_model.yaml"),
         f"policy.model_name={model_dir}", "data.train.data_path=trl_style.jsonl",
         "data.reward=my_rewards:digits", "data.prompt_template=Question {prompt}", "runtime.device=cpu",
         "policy.precision=float32", "data.eval_size=2", "grpo.num_generations_per_prompt=2",
         "grpo.num_prompts_per_step=3", "partial_rollouts.token_budget=8",
         "partial_rollouts.max_response_tokens=16", "partial_rollouts.max_in_flight_groups=4",
         "grpo.max_num_steps=1", "eval.k=1", "--no-progress",
        cwd=tmp_path, env=cli_process.cli_env(), timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answers = {f"Question {r['prompt']}": r["answer"] for r in rows}
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) >= 3 * 2  # the step's 3 groups of 2 (all finished), plus the held-out rows
    for call in calls:
        assert call["other"] == [] and [len(call[k]) for k in ("prompts", "completions", "answer")] == [1, 1, 1]
        assert answers[call["prompts"][0]] == call["answer"][0]  # the answer of that very prompt
    run = tmp_path / "runs" / "own_model"
    [step] = [json.loads(line) for line in (run / "trained_groups.jsonl").read_text().splitlines()]
    trained = [rows[int(g["prompt_id"].split("#")[0].rsplit("-", 1)[1])]["answer"] for g in step["groups"]]
    [metrics] = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m["step"] == 1]
    assert metrics["reward/mean"] == pytest.approx(sum(len(a) / 10 for a in trained) / len(trained))


def test_a_reward_that_cannot_be_used_is_one_error_naming_data_reward(tmp_path, monkeypatch):
    from bapo_nemo.embedded.data.rewards import reward_function
    from bapo_nemo.embedded.data.tasks import Task

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the module's directory is added while resolving it
    (tmp_path / "shaky_rewards.py").write_text(
        "def pair(completions, **kwargs):\n    return [1.0, 0.0]\n"
        "def none(completions, **kwargs):\n    return [None]\n"
        "def half(completions, answer, **kwargs):\n    return [0.5 for _ in completions]\n"
    )
    monkeypatch.delitem(sys.modules, "shaky_rewards", raising=False)
    task = Task("t-0", "What is 1 + 1?", "2")
    assert reward_function("shaky_rewards:half", "answer")("2", task) == 0.5
    with pytest.raises(DataError, match=r"data.reward=no_such_module:f: cannot import module 'no_such_module'"):
        reward_function("no_such_module:f", "answer")
    with pytest.raises(DataError, match=r"data.reward=shaky_rewards:missing: .*shaky_rewards.py has no function"):
        reward_function("shaky_rewards:missing", "answer")
    with pytest.raises(DataError, match=r"returned \[1.0, 0.0\] for one completion"):
        reward_function("shaky_rewards:pair", "answer")("2", task)
    with pytest.raises(DataError, match="returned the reward None: each reward must be a finite number"):
        reward_function("shaky_rewards:none", "answer")("2", task)
    with pytest.raises(TypeError, match="answer"):  # the answer comes under its column's name, as in TRL
        reward_function("shaky_rewards:half", "final")("2", task)
