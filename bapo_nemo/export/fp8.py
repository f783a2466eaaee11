"""Post-training FP8 quantisation for serving, with NVIDIA ModelOpt (`pip install -e '.[fp8]'` in the
checkout: bapo-nemo is not on PyPI); runs on CPU (docs/export.md, "FP8 for serving").

`mtq.quantize(model, mtq.FP8_DEFAULT_CFG, calibrate)` makes every linear layer's weights and inputs
per-tensor e4m3 (embeddings and lm_head excluded); `export_hf_checkpoint` writes what vLLM and TensorRT-LLM
load. transformers ignores the scales on CPU, so parity dequantises the written weights, and compares the
fake-quantised model too; FP8 is lossy: it passes on mean |dlogp| within `FP8_MEAN_TOLERANCE`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from bapo_nemo.embedded.run.prompt_format import response_tokens
from bapo_nemo.export.checkpoint import CheckpointRef, ExportError
from bapo_nemo.export.hf import (
    ExportResult,
    atomic_output_dir,
    load_embedded,
    prompting_of,
    save_round_trip_tokenizer,
)
from bapo_nemo.export.model_card import model_card, portable_info
from bapo_nemo.export.parity import compare, heldout_sequences, token_logprobs

FP8_MEAN_TOLERANCE = 0.05  # nats per token, averaged; a broken scale gives O(1)
MODELOPT_REQUIREMENT = "nvidia-modelopt>=0.20"  # as pyproject.toml's fp8 extra


def import_modelopt():
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except (ImportError, RuntimeError) as exc:  # RuntimeError: CUDA-only extensions probed at import
        # bapo-nemo is installed from its checkout, not PyPI: `pip install 'bapo-nemo[fp8]'` would find nothing
        raise ExportError(f"--fp8 needs NVIDIA ModelOpt, which does not import here ({exc}): in the bapo-nemo "
                          f"checkout run pip install -e '.[fp8]' (or pip install '{MODELOPT_REQUIREMENT}' into "
                          "this environment)") from exc
    return mtq, export_hf_checkpoint


def dequantized_state_dict(export_dir: Path) -> dict[str, torch.Tensor]:
    """Weights of a ModelOpt FP8 export as float32: fp8 weight * weight_scale; scales dropped."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale", ".input_scale", ".weight_scale")):
            continue
        scale = tensors.get(name[: -len("weight")] + "weight_scale") if name.endswith("weight") else None
        out[name] = tensor.float() * scale.float() if scale is not None else tensor.float()
    return out


def export_fp8(ref: CheckpointRef, out: str | Path, force: bool = False, parity_prompts: list[str] | None = None,
               progress=print) -> ExportResult:
    from transformers import AutoModelForCausalLM

    mtq, export_hf_checkpoint = import_modelopt()
    model, tokenizer, info, config = load_embedded(ref)
    fmt, example, response = prompting_of(model, tokenizer, config, info)  # the source model's answer
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]  # ModelOpt's export reads it
    sequences = heldout_sequences(model, tokenizer, prompts=parity_prompts)
    reference = token_logprobs(model, sequences)
    source_config = model.config.to_dict()

    def calibrate(m):
        with torch.no_grad():
            for ids in sequences:
                x = torch.tensor([ids])
                m(input_ids=x, attention_mask=torch.ones_like(x))

    progress("FP8 (e4m3) post-training quantisation with ModelOpt, calibrating on held-out sequences")
    quantized = mtq.quantize(model, mtq.FP8_DEFAULT_CFG, calibrate)
    fake_quant = compare(reference, token_logprobs(quantized, sequences), FP8_MEAN_TOLERANCE, criterion="mean")
    progress(f"fake-quantised model (FP8 weights and activations) vs source: {fake_quant.summary()}")

    with atomic_output_dir(out, force, ref.path) as tmp:
        export_hf_checkpoint(quantized, export_dir=str(tmp))
        save_round_trip_tokenizer(fmt.tokenizer, tmp)
        if (ref.path / "model" / "generation_config.json").is_file():
            shutil.copy2(ref.path / "model" / "generation_config.json", tmp / "generation_config.json")
        (tmp / "bapo_training_info.json").write_text(json.dumps(portable_info(info), indent=2))

        # reload the written FP8 weights, dequantised, into the source architecture
        plain_config = type(model.config).from_dict({k: v for k, v in source_config.items()
                                                     if k != "quantization_config"})
        reloaded = AutoModelForCausalLM.from_config(plain_config).eval()
        state = dequantized_state_dict(tmp)
        missing, unexpected = reloaded.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and plain_config.tie_word_embeddings)]
        if missing or unexpected:
            raise ExportError(f"FP8 export in {tmp} does not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
        if plain_config.tie_word_embeddings:
            reloaded.tie_weights()
        parity = compare(reference, token_logprobs(reloaded, sequences), FP8_MEAN_TOLERANCE, criterion="mean")
        progress(f"written FP8 weights (dequantised) vs source: {parity.summary()}")
        if not (parity.passed and fake_quant.passed):
            raise ExportError(f"FP8 export of {ref.path} failed its parity check (weights: {parity.summary()}; "
                              f"weights+activations: {fake_quant.summary()}); nothing was written")
        prompting = fmt.section(example, response_tokens(config), response, when="before quantisation")
        (tmp / "README.md").write_text(model_card(info, parity, ref.path, fp8=True, prompting=prompting)
                                       + f"\nWith FP8 activations too (as served): {fake_quant.summary()}\n")
    return ExportResult(Path(out).resolve(), parity, ref.path, info.get("step"), info.get("mlflow_run_id"),
                        extra={"fake_quant_parity": fake_quant})
