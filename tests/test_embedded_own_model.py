"""Your own model and data on the embedded trainer: any HF causal LM (`model.pretrained`) and a local
Hugging Face `datasets` source (`data.*`), graded by math-verify. Nothing can be downloaded here, so each
test builds tiny random models of real families (Qwen2, Qwen3, Llama) from their configs, with a BPE
tokenizer trained on the spot, and saves them with `save_pretrained`: the trainer loads them exactly as it
loads a downloaded model. Nothing is faked; the `gpu` test runs the same path on CUDA."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
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

from bapo_nemo.embedded.config import load_config
from bapo_nemo.embedded.data import DataError, load_data, math_verify_reward
from bapo_nemo.embedded.evaluation import encode_prompt
from bapo_nemo.embedded.model import ModelLoadError
from bapo_nemo.embedded.trainer import _tasks, train

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


def save_tiny_model(family: str, where: Path) -> Path:
    config_cls, model_cls, tok_kwargs = FAMILIES[family]
    tok = make_tokenizer(**tok_kwargs)
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = where / f"tiny-{family}"
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
            f"model.pretrained={model_dir}",
            f"data.train_path={data_path}",
            "data.prompt_field=problem",
            "data.answer_field=final",
            "data.eval_size=4",
            "data.prompt_template={prompt} Put the answer in \\boxed{}.",
            "warmup.steps=0",
            "rollout.group_size=2",
            "rollout.prompts_per_step=2",
            "rollout.partial.token_budget=8",
            "rollout.partial.max_resumptions=2",
            "rollout.partial.max_response_tokens=16",
            "rollout.partial.max_in_flight_groups=4",
            "train.max_steps=2",
            "train.micro_batch_size=4",
            "eval.every=2",
            "eval.k=1",
            "checkpoint.every=1",
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


def test_bf16_autocast_and_gradient_checkpointing_on_cpu_and_resume(tmp_path):
    """The code path of `runtime.device=cuda` (autocast, checkpointing), on CPU, through a resume."""
    model_dir = save_tiny_model("qwen2", tmp_path)
    data = write_dataset(tmp_path / "math.parquet", MATH_ROWS)
    extra = ("runtime.autocast=bf16", "train.gradient_checkpointing=true")
    out = tmp_path / "run"
    first = train(run_config(tmp_path, model_dir, data, *extra, "train.max_steps=1"), out)
    assert first["step"] == 1
    summary = train(run_config(tmp_path, model_dir, data, *extra, "train.max_steps=2"), out, resume=True)
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
    _, eval_tasks, pool, score = _tasks(cfg, tok, 128)
    task = next(t for t in pool if t.answer == "7")
    assert task.question.endswith("Put the answer in \\boxed{}.")
    assert score("3 + 4 = \\boxed{7}", task) == 1.0
    assert score("#7", task) == 0.0  # the arithmetic reward's format is not an answer here
    assert {t.question for t in eval_tasks}.isdisjoint(t.question for t in pool)
    assert len(eval_tasks) == 4 and len(pool) == len(MATH_ROWS) - 4

    bundled = load_config(None, ["runtime.progress=false"])
    _, _, _, arithmetic = _tasks(bundled, tok, 256)
    from bapo_nemo.embedded.tasks import Task

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
            f"data.train_path={data}",
            "data.prompt_field=problem",
            "data.answer_field=final",
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
            f"data.train_path={jsonl}",
            f"data.eval_path={disk}",
            "data.prompt_field=problem",
            "data.answer_field=final",
        ],
    )
    train_tasks, held_out = load_data(cfg.data, seed=0)
    assert len(train_tasks) == len(MATH_ROWS) and len(held_out) == 5
    assert held_out[0].question == "What is 1 + 1?" and held_out[0].answer == "2"


def test_bad_input_names_the_key_or_file(tmp_path):
    data = write_dataset(tmp_path / "math.parquet", MATH_ROWS)
    # a dataset without the mapped field
    cfg = load_config(None, [f"data.train_path={data}", "data.answer_field=final"])
    with pytest.raises(DataError, match=r"no column 'question' \(data.prompt_field\).*'problem'"):
        load_data(cfg.data, seed=0)
    # a missing file, an unknown format
    cfg = load_config(None, [f"data.train_path={tmp_path / 'nope.parquet'}"])
    with pytest.raises(DataError, match="data.train_path.*does not exist"):
        load_data(cfg.data, seed=0)
    (tmp_path / "rows.txt").write_text("x")
    cfg = load_config(None, [f"data.train_path={tmp_path / 'rows.txt'}"])
    with pytest.raises(DataError, match="suffix '.txt'"):
        load_data(cfg.data, seed=0)
    # a directory that is not a model
    (tmp_path / "not_a_model").mkdir()
    cfg = run_config(tmp_path, tmp_path / "not_a_model", data)
    with pytest.raises(ModelLoadError, match="model.pretrained=.*not a model directory"):
        train(cfg, tmp_path / "run")


def test_overlong_prompts_are_skipped_and_counted_or_truncated(tmp_path):
    model_dir = save_tiny_model("llama", tmp_path)
    rows = MATH_ROWS + [{"problem": "What is " + " + ".join(["1"] * 60) + "?", "final": "60"}]
    data = write_dataset(tmp_path / "math.parquet", rows)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token = tok.eos_token
    window = 64  # max_response_tokens=16 leaves 48 prompt tokens: the long row needs more
    cfg = run_config(tmp_path, model_dir, data, "data.eval_path=" + str(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encode, eval_tasks, pool, _ = _tasks(cfg, tok, window)
    assert len(pool) == len(MATH_ROWS) and len(eval_tasks) == len(MATH_ROWS)
    assert any(
        "skipped 1 training prompt(s)" in str(w.message) and "math-32" in str(w.message) for w in caught
    )

    cfg = run_config(
        tmp_path, model_dir, data, "data.eval_path=" + str(data), "data.overlong_prompts=truncate"
    )
    encode, eval_tasks, pool, _ = _tasks(cfg, tok, window)
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
        "runtime.autocast=bf16",
        "train.gradient_checkpointing=true",
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
    from bapo_nemo.embedded.model import prepare_model

    model_dir = save_tiny_model("qwen2", tmp_path)
    ids = torch.tensor([[1, 5, 7, 9]])
    plain = prepare_model(
        AutoModelForCausalLM.from_pretrained(model_dir), torch.device("cpu"), "float32", "none", False
    )
    assert plain(input_ids=ids).logits.dtype == torch.float32
    assert not plain.is_gradient_checkpointing
    fast = prepare_model(
        AutoModelForCausalLM.from_pretrained(model_dir), torch.device("cpu"), "float32", "bf16", True
    )
    assert fast(input_ids=ids).logits.dtype == torch.bfloat16
    assert next(fast.parameters()).dtype == torch.float32
    assert fast.is_gradient_checkpointing
    # close to the fp32 logits (bf16 has ~3 significant digits)
    torch.testing.assert_close(
        fast(input_ids=ids).logits.float(), plain(input_ids=ids).logits, atol=5e-2, rtol=5e-2
    )


def test_the_example_config_validates_and_runs_on_a_local_model_and_dataset_from_the_cli(tmp_path):
    """configs/own_model.yaml as the README runs it (a subprocess of the CLI), pointed at a local model
    and JSONL file, on CPU, for one step; and a directory that is not a model gives a one-line error."""
    import subprocess
    import sys

    model_dir = save_tiny_model("qwen2", tmp_path)
    jsonl = tmp_path / "my_math.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"question": r["problem"], "answer": r["final"]}) + "\n" for r in MATH_ROWS)
    )
    repo = Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "bapo_nemo.cli", "train", str(repo / "configs" / "own_model.yaml")]
    small = [
        f"data.train_path={jsonl}",
        "data.eval_size=4",
        "runtime.device=cpu",
        "runtime.autocast=none",
        "rollout.group_size=2",
        "rollout.prompts_per_step=2",
        "rollout.partial.token_budget=8",
        "rollout.partial.max_response_tokens=16",
        "rollout.partial.max_in_flight_groups=4",
        "train.max_steps=1",
        "eval.k=1",
        "--no-progress",
    ]
    done = subprocess.run(
        [*base, f"model.pretrained={model_dir}", *small, "--output-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["step"] == 1
    assert (tmp_path / "run" / "hf_final" / "COMPLETE").is_file()

    (tmp_path / "empty").mkdir()
    bad = subprocess.run(
        [*base, f"model.pretrained={tmp_path / 'empty'}", *small, "--output-dir", str(tmp_path / "run2")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("error: model.pretrained=")
    assert "not a model directory" in bad.stderr
