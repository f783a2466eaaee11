"""`bapo-nemo export` of embedded checkpoints: a tiny Qwen2 saved with the trainer's own checkpoint writer
(contract 1) and the bundled tokenizer, exported, reloaded with transformers and compared; corrupted and
partial checkpoints; MLflow model registration (sqlite store); FP8 with NVIDIA ModelOpt on CPU."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.algorithm import BAPOConfig
from bapo_nemo.cli import main as cli_main
from bapo_nemo.embedded.model.tokenizer import load_tokenizer
from bapo_nemo.embedded.output.checkpoint import save_checkpoint
from bapo_nemo.export.checkpoint import ExportError, resolve_checkpoint, validate_embedded
from bapo_nemo.export.hf import export_embedded
from bapo_nemo.export.parity import compare
from tests.support import cli_process
from tests.support.hang_guard import HANG_GUARD_S


def tiny_model(tokenizer, seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def write_checkpoint(output_dir: Path, step: int, run_id: str | None = "run-abc", uri: str | None = None,
                     seed: int = 0) -> Path:
    tokenizer = load_tokenizer()
    model = tiny_model(tokenizer, seed)
    info = {"step": step, "mlflow_run_id": run_id, "mlflow_tracking_uri": uri, "config_hash": "0123abcd",
            "bapo": BAPOConfig().model_dump(mode="json"), "model_name": "tiny-qwen2"}
    return save_checkpoint(output_dir, step, model, tokenizer, {"step": step}, {"manager": {}},
                           {"loss_fn": {"bapo": {"rho0": 0.4}}}, info, keep_last=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("run"), step=3)


def test_round_trip_with_parity(checkpoint, tmp_path):
    out = tmp_path / "hf"
    result = export_embedded(resolve_checkpoint(checkpoint), out)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md",
                 "bapo_training_info.json"):
        assert (out / name).is_file(), name
    assert result.parity.passed and result.parity.max_abs_diff <= 1e-4 and result.parity.num_tokens > 50
    card = (out / "README.md").read_text()
    assert "run-abc" in card and "| step | `3` |" in card and "| `rho0` | `0.4` |" in card
    assert "| `c_high_max` | `3.0` |" in card and "parity PASS" in card
    # the plain AutoTokenizer path encodes as the trainer does: BOS (1) first, ' ' = 21, 'x' -> <unk> = 3
    # (transformers 5 would pick Qwen2Tokenizer for a qwen2 config, which drops spaces and adds no BOS)
    assert AutoTokenizer.from_pretrained(out)("12+3=? x")["input_ids"] == [1, 5, 6, 14, 7, 17, 20, 21, 3]
    assert not list(tmp_path.glob(".hf.partial-*"))

    # independent check: logits of the exported model equal the checkpoint's on a fixed input
    source = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = AutoTokenizer.from_pretrained(out)("12+34=?", return_tensors="pt")["input_ids"]
    # specials are ids 0..3, '0'..'9' are 4..13, then '+'=14 '-'=15 '*'=16 '='=17 ';'=18 '#'=19 '?'=20
    assert ids[0].tolist() == [1, 5, 6, 14, 7, 8, 17, 20]
    with torch.no_grad():
        assert torch.equal(source(ids).logits, exported(ids).logits)


def test_cli_refuses_existing_dir_then_force_replaces_only_a_previous_export(checkpoint, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert cli_main(["export", str(checkpoint), "--out", str(out)]) == 2
    assert "already exists: pass --force" in capsys.readouterr().err
    # --force does not replace a directory that is not a previous export
    assert cli_main(["export", str(checkpoint), "--out", str(out), "--force"]) == 2
    assert "is not a previous bapo-nemo export" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    out.rmdir()
    assert cli_main(["export", str(checkpoint), "--out", str(out)]) == 0
    (out / "stale.txt").write_text("from the previous export")
    assert cli_main(["export", str(checkpoint), "--out", str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    verdicts = [line for line in printed.splitlines() if "max_abs_logprob_diff=" in line]
    assert verdicts and all(v.startswith("parity PASS: max_abs_logprob_diff=") for v in verdicts), printed
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # no temp or old dirs left


def test_output_dir_resolves_to_newest_complete_checkpoint(tmp_path):
    write_checkpoint(tmp_path / "run", step=1)
    write_checkpoint(tmp_path / "run", step=2)
    partial = tmp_path / "run" / "checkpoints" / "step_9"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_2", partial)
    (partial / "COMPLETE").unlink()
    ref = resolve_checkpoint(tmp_path / "run")
    assert ref.kind == "embedded" and ref.path.name == "step_2" and ref.step == 2
    with pytest.raises(ExportError, match="no COMPLETE marker, so this checkpoint is partial"):
        validate_embedded(resolve_checkpoint(partial))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c: _truncate(c / "model" / "model.safetensors"), r"model/model\.safetensors is truncated"),
        (lambda c: (c / "model" / "model.safetensors").write_bytes(b"\xff" * 4), r"model\.safetensors is corrupted"),
        (lambda c: (c / "model" / "model.safetensors").unlink(), r"model/model\.safetensors is missing"),
        (lambda c: (c / "tokenizer" / "tokenizer.json").unlink(), r"tokenizer/tokenizer\.json is missing"),
        (lambda c: (c / "training_info.json").unlink(), r"training_info\.json is missing"),
        (lambda c: (c / "model" / "config.json").write_text("{not json"), r"model/config\.json is corrupted"),
    ],
)
def test_corrupted_checkpoint_names_the_file_and_writes_nothing(checkpoint, tmp_path, damage, message, capsys):
    broken = tmp_path / "step_3"
    shutil.copytree(checkpoint, broken)
    damage(broken)
    out = tmp_path / "out"
    assert cli_main(["export", str(broken), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err
    import re

    assert re.search(message, err), err
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def test_compare_by_hand():
    # |-1.0 - -1.5| = 0.5, |-2 - -2| = 0, |-0.1 - -0.3| = 0.2 -> max 0.5, mean 0.7 / 3
    result = compare([[-1.0, -2.0], [-0.1]], [[-1.5, -2.0], [-0.3]], tolerance=0.25)
    assert result.max_abs_diff == pytest.approx(0.5) and result.mean_abs_diff == pytest.approx(0.7 / 3)
    assert result.num_tokens == 3 and not result.passed
    assert compare([[-1.0]], [[-1.00001]], tolerance=1e-4).passed
    assert not compare([[-1.0]], [[-1.0]], tolerance=1e-4, tokenizer_match=False).passed
    with pytest.raises(ValueError, match="sequence 0 has 2 reference log-probs vs 1"):
        compare([[-1.0, -2.0]], [[-1.0]], tolerance=1.0)


def test_register_model_links_version_to_the_training_run(tmp_path):
    from mlflow.tracking import MlflowClient

    from bapo_nemo.tracking.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = MlflowTracker(uri, "export-test", buffer_dir=tmp_path / "buf")
    run_id = tracker.start({"a": 1}, {})
    tracker.finish()
    ckpt = write_checkpoint(tmp_path / "run", step=5, run_id=run_id, uri=uri)
    assert cli_main(["export", str(ckpt), "--out", str(tmp_path / "hf"), "--register-model", "bapo-tiny"]) == 0
    client = MlflowClient(uri, registry_uri=uri)
    (version,) = client.search_model_versions("name='bapo-tiny'")
    assert version.run_id == run_id and version.tags["bapo.step"] == "5"
    assert version.source.endswith("/hf_export")
    assert {a.path for a in client.list_artifacts(run_id, "hf_export")} >= {"hf_export/model.safetensors",
                                                                             "hf_export/README.md"}
    assert float(client.get_run(run_id).data.tags["bapo.hf_export.parity_max_abs_diff"]) <= 1e-4


def test_register_without_run_id_is_a_clear_error(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "run", step=1, run_id=None, uri=f"sqlite:///{tmp_path}/m.db")
    assert cli_main(["export", str(ckpt), "--out", str(tmp_path / "hf"), "--register-model", "m"]) == 2
    assert "records no MLflow run id" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()  # refused before exporting


@pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                    reason="nvidia-modelopt not installed: pip install -e '.[fp8]'")
def test_fp8_export_with_modelopt_on_cpu(checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file

    out = tmp_path / "fp8"
    assert cli_main(["export", str(checkpoint), "--out", str(out), "--fp8"]) == 0
    printed = capsys.readouterr().out
    assert "written FP8 weights (dequantised) vs source: parity PASS" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    assert config["quantization_config"]["quant_algo"] == "FP8"
    exported = load_file(str(out / "model.safetensors"))
    source = load_file(str(checkpoint / "model" / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert exported[name].dtype == torch.float8_e4m3fn
    # e4m3 with per-tensor scale s = amax / 448: in the top binade [256, 448] the grid step is 32, so the
    # rounding error is at most 16 * s = amax / 28 (smaller binades are finer)
    w = source[name].float()
    deq = exported[name].float() * exported[name + "_scale"].float()
    assert (deq - w).abs().max() <= w.abs().max() / 28 + 1e-7
    assert (out / "tokenizer.json").is_file() and "FP8" in (out / "README.md").read_text()


def without_modelopt() -> None:
    """What `import modelopt` answers in a Python environment where nvidia-modelopt is not installed."""
    sys.modules["modelopt"] = None


def test_fp8_without_modelopt_gives_the_install_command_that_works(checkpoint, tmp_path):
    """`bapo-nemo export --fp8` where ModelOpt does not import: one line with the command that installs it
    from the checkout (bapo-nemo is not on PyPI, so `pip install 'bapo-nemo[fp8]'` would find nothing), exit
    2, and nothing written at --out."""
    out = tmp_path / "fp8"
    blocked = "import sys; sys.modules['modelopt'] = None; from bapo_nemo.cli import main; sys.exit(main())"
    proc = cli_process.start("export", str(checkpoint), "--out", str(out), "--fp8", cwd=tmp_path,
                             env=cli_process.cli_env(), before_main=without_modelopt,
                             exec_command=[sys.executable, "-c", blocked])
    stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 2, stderr[-2000:]
    [line] = stderr.strip().splitlines()
    assert line.startswith("bapo-nemo export: error: --fp8 needs NVIDIA ModelOpt")
    assert "in the bapo-nemo checkout run pip install -e '.[fp8]'" in line
    assert "pip install 'nvidia-modelopt>=0.20'" in line and "bapo-nemo[fp8]" not in line
    assert stdout == "" and not out.exists() and list(tmp_path.iterdir()) == []
