"""Export of NeMo-RL Megatron checkpoints. Megatron-Bridge and transformer-engine cannot be imported here, so
these tests replace only NeMo-RL's `export_model_from_megatron` (the boundary) with a stand-in that writes a
tiny HF model the way Megatron-Bridge's `save_hf_pretrained` would; the layout detection, the
hf_config_overrides fix, the parity against training-time log-probs and the atomic write are ours and run
for real (a real checkpoint, in the container: tests/nemo_rl/test_export_megatron.py, marked gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.cli import main as cli_main
from bapo_nemo.export import megatron, megatron_python
from bapo_nemo.export.checkpoint import resolve_checkpoint
from bapo_nemo.export.parity import read_reference_logprobs, write_reference_logprobs
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def nemo_step_dir(root: Path, overrides_key: str = "hf_config_overrides") -> Path:
    step = root / "results" / "grpo" / "step_40"
    (step / "policy" / "weights" / "iter_0000040").mkdir(parents=True)
    (step / "policy" / "weights" / "iter_0000040" / "metadata.json").write_text("{}")
    config = {"policy": {"model_name": "Qwen/Qwen2.5-1.5B", "tokenizer": {"name": "Qwen/Qwen2.5-1.5B"},
                         overrides_key: {"rope_theta": 500000.0}},
              "loss_fn": {"bapo": {"rho0": 0.4, "enabled": True}}}
    (step / "config.yaml").write_text(yaml.safe_dump(config))
    (step.parent / "mlflow_run.json").write_text(json.dumps({"run_id": "r-77", "tracking_uri": "sqlite:///x.db"}))
    return step


def tiny_hf_model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


class StandInExporter:
    """Records the call and writes what Megatron-Bridge would: an HF directory at output_path."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        assert not os.path.exists(kwargs["output_path"])  # the real one refuses an existing dir
        self.model.save_pretrained(kwargs["output_path"])


def manual_logprobs(model, seq: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
    return [float(torch.log_softmax(logits[t], -1)[seq[t + 1]]) for t in range(len(seq) - 1)]


def test_layout_weights_and_overrides(tmp_path):
    step = nemo_step_dir(tmp_path)
    ref = resolve_checkpoint(step)
    assert ref.kind == "nemo_rl" and ref.step == 40
    assert megatron.megatron_weights_path(step).name == "iter_0000040"
    config = megatron.read_nemo_config(step)
    assert megatron.hf_overrides(config["policy"]) == {"rope_theta": 500000.0}
    assert megatron.hf_overrides({"hf_overrides": {"a": 1}}) == {"a": 1}  # the converter script's spelling
    (step / "config.yaml").write_text("policy: {}\n")
    with pytest.raises(megatron.ExportError, match=r"config\.yaml: no policy\.model_name"):
        megatron.read_nemo_config(step)


def test_export_passes_overrides_and_checks_parity_against_recorded_logprobs(tmp_path, monkeypatch, capsys):
    step = nemo_step_dir(tmp_path)
    model = tiny_hf_model()
    sequences = [[1, 5, 9, 12, 3], [7, 7, 2, 30, 31, 8]]
    write_reference_logprobs(step, sequences, [manual_logprobs(model, s) for s in sequences], "float32", "test")
    assert read_reference_logprobs(step)["sequences"] == sequences
    exporter = StandInExporter(model)
    monkeypatch.setattr(megatron, "_import_exporter", lambda: exporter)
    out = tmp_path / "hf"
    assert cli_main(["export", str(step), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    verdicts = [line for line in printed.splitlines() if "max_abs_logprob_diff=" in line]
    assert verdicts and all(v.startswith("parity PASS: max_abs_logprob_diff=") for v in verdicts), printed
    (call,) = exporter.calls
    assert call["hf_overrides"] == {"rope_theta": 500000.0}  # v0.7.0's script would pass {}
    assert call["input_path"].endswith("step_40/policy/weights/iter_0000040")
    assert call["hf_model_name"] == "Qwen/Qwen2.5-1.5B"
    info = json.loads((out / "bapo_training_info.json").read_text())
    assert info["mlflow_run_id"] == "r-77" and info["step"] == 40 and info["bapo"]["rho0"] == 0.4
    assert "r-77" in (out / "README.md").read_text()


def test_parity_failure_writes_nothing(tmp_path, monkeypatch, capsys):
    step = nemo_step_dir(tmp_path)
    sequences = [[1, 5, 9, 12, 3]]
    # reference from a different model (another seed): the exported weights do not reproduce it
    write_reference_logprobs(step, sequences, [manual_logprobs(tiny_hf_model(seed=1), sequences[0])], "float32", "t")
    monkeypatch.setattr(megatron, "_import_exporter", lambda: StandInExporter(tiny_hf_model(seed=0)))
    assert cli_main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert "failed its parity check" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))


def test_without_recorded_logprobs_parity_is_reported_not_checked(tmp_path, monkeypatch, capsys):
    step = nemo_step_dir(tmp_path)
    monkeypatch.setattr(megatron, "_import_exporter", lambda: StandInExporter(tiny_hf_model()))
    assert cli_main(["export", str(step), "--out", str(tmp_path / "hf")]) == 0
    assert "parity NOT CHECKED" in capsys.readouterr().out
    assert "not checked" in (tmp_path / "hf" / "README.md").read_text()


def test_outside_the_container_the_error_says_where_to_run(tmp_path, capsys):
    step = nemo_step_dir(tmp_path)
    assert cli_main(["export", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert "nvcr.io/nvidia/nemo-rl:v0.7.0" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_reference_file_shape_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"len\(logprobs\[i\]\) == len\(sequences\[i\]\) - 1"):
        write_reference_logprobs(tmp_path, [[1, 2, 3]], [[-0.5]], "bfloat16", "t")


# ---- which Python converts (the image's default venv has no Megatron-Bridge) -----------------------------
def recording_python(path: Path, log: Path) -> Path:
    """A stand-in for a venv's bin/python that records how it was called, then runs this Python (the real
    worker venv, with Megatron-Bridge, exists only in the image)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/bash\n"
        f'printf "%s\\n" "$@" > "{log}"\n'
        f'echo "CHILD=${{BAPO_EXPORT_IN_MEGATRON_PYTHON:-}} PWD=$PWD" >> "{log}"\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    path.chmod(0o755)
    return path


def test_export_of_a_nemo_rl_checkpoint_reruns_in_the_megatron_worker_venv(tmp_path):
    """`bapo-nemo export` with a Python lacking Megatron-Bridge re-runs itself with the Megatron worker
    venv's Python ($NEMO_RL_VENV_DIR/<MegatronPolicyWorker fqn>/bin/python), paths made absolute; its
    exit code is the export's."""
    step = nemo_step_dir(tmp_path)
    venvs, log = tmp_path / "ray_venvs", tmp_path / "child.log"
    worker = venvs / megatron_python.MEGATRON_WORKER / "bin" / "python"
    recording_python(worker, log)
    env = {**os.environ, "PYTHONPATH": str(REPO), "NEMO_RL_VENV_DIR": str(venvs)}
    env.pop(megatron_python.CHILD_ENV, None)
    rel_step = os.path.relpath(step, tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "bapo_nemo.cli", "export", rel_step, "--out", "hf", "--force"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )
    assert f"exporting with {worker}" in result.stdout
    argv = log.read_text().splitlines()
    assert argv[:7] == ["-m", "bapo_nemo.cli", "export", str(step), "--out", str(tmp_path / "hf"), "--force"]
    assert argv[-1].startswith("CHILD=1 ")  # the child does not re-run itself again
    # Here the stand-in venv has no Megatron-Bridge either: the child fails and says where it looked.
    assert result.returncode == 2
    assert "needs NeMo-RL v0.7.0 with Megatron-Bridge" in result.stderr and str(worker) in result.stderr


def test_megatron_python_order(tmp_path, monkeypatch):
    """Worker venv first, then `uv run --extra mcore` in NeMo-RL's source, else none (export fails here)."""
    monkeypatch.setattr(megatron_python, "has_megatron_bridge", lambda: False)
    monkeypatch.setenv("NEMO_RL_VENV_DIR", str(tmp_path / "venvs"))
    monkeypatch.setenv("NEMO_RL_DIR", str(tmp_path / "nemo-rl"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert megatron_python.megatron_python() is None
    (tmp_path / "nemo-rl").mkdir()
    (tmp_path / "nemo-rl" / "pyproject.toml").write_text("[project]\nname='nemo-rl'\n")
    (tmp_path / "bin").mkdir()
    uv = tmp_path / "bin" / "uv"
    uv.write_text("#!/bin/sh\n")
    uv.chmod(0o755)
    assert megatron_python.megatron_python() == [
        str(uv), "run", "--locked", "--extra", "mcore", "--directory", str(tmp_path / "nemo-rl"), "python"]
    worker = recording_python(tmp_path / "venvs" / megatron_python.MEGATRON_WORKER / "bin" / "python",
                              tmp_path / "log")
    assert megatron_python.megatron_python() == [str(worker)]
    monkeypatch.setattr(megatron_python, "has_megatron_bridge", lambda: True)
    assert megatron_python.megatron_python() is None  # this Python can do it itself


# ---- parity of FP8-trained checkpoints --------------------------------------------------------------------
def test_blockwise_quantisation_by_hand():
    """One 1x128 tile holding 1.0 and 3.0: scale 448/3, 1.0 -> 149.33 rounds to e4m3's 144 (step 16 in
    [128, 256)), so it comes back as 144 / 149.33 = 0.9643; 3.0 -> 448 exactly."""
    from bapo_nemo.export.fp8_blockwise import quantize_dequantize

    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 1.0, 3.0
    q = quantize_dequantize(x, 1, 128)
    assert q[0, 0].item() == pytest.approx(144 * 3 / 448, rel=1e-6)
    assert q[0, 1].item() == pytest.approx(3.0, rel=1e-6)
    assert torch.count_nonzero(q[0, 2:]) == 0


def test_fp8_trained_checkpoint_passes_on_the_mean_and_wrong_weights_still_fail(tmp_path, monkeypatch, capsys):
    """Reference log-probs from the blockwise-FP8 forward (as NeMo-RL records them for an FP8-trained
    policy) against the bf16 export of the same weights: max |dlogp| > 0.05 (the bf16 rule would refuse),
    mean well under it. Other weights fail the FP8 rule too."""
    from transformers import Qwen2Config

    from bapo_nemo.export.fp8_blockwise import blockwise_fp8_linears
    from bapo_nemo.export.parity import token_logprobs

    def model(seed):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=768,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2)).to(torch.bfloat16).eval()

    trained = model(0)
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(512, (40,), generator=gen).tolist() for _ in range(6)]
    with blockwise_fp8_linears(trained):
        reference = token_logprobs(trained, sequences)
    bf16 = token_logprobs(trained, sequences)
    assert max(abs(a - b) for r, c in zip(reference, bf16) for a, b in zip(r, c)) > 0.05

    def export(step, exported, out):
        write_reference_logprobs(step, sequences, reference, "bfloat16", "test: blockwise FP8 forward")
        monkeypatch.setattr(megatron, "_import_exporter", lambda: StandInExporter(exported))
        return cli_main(["export", str(step), "--out", str(tmp_path / out)])

    def fp8_step(root):
        step = nemo_step_dir(root)
        config = yaml.safe_load((step / "config.yaml").read_text())
        config["policy"]["megatron_cfg"] = {"enabled": True, "fp8_cfg": {"enabled": True, "fp8_recipe": "blockwise"}}
        (step / "config.yaml").write_text(yaml.safe_dump(config))
        return step

    assert export(fp8_step(tmp_path / "a"), trained, "ok") == 0
    assert "parity PASS" in capsys.readouterr().out
    assert export(nemo_step_dir(tmp_path / "b"), trained, "bf16_rule") == 2  # same data under the bf16 rule
    assert "failed its parity check" in capsys.readouterr().err
    assert export(fp8_step(tmp_path / "c"), model(7), "wrong") == 2
    assert "failed its parity check" in capsys.readouterr().err
