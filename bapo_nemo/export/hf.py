"""Embedded checkpoint -> Hugging Face directory (safetensors, config, generation config, tokenizer, model
card), written into a temporary sibling directory and renamed into place only after the parity check
passed, so a failed or interrupted export never leaves a half-written directory behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bapo_nemo.export.checkpoint import CheckpointRef, ExportError, validate_embedded
from bapo_nemo.export.parity import (
    ParityResult,
    compare,
    heldout_sequences,
    representable_prompts,
    token_logprobs,
    tolerance_for,
)


@dataclass
class ExportResult:
    out_dir: Path
    parity: ParityResult
    source: Path
    step: int | None
    run_id: str | None
    extra: dict = field(default_factory=dict)


@contextmanager
def atomic_output_dir(out: str | Path, force: bool):
    """Yield a temp dir next to ``out``; on success it replaces ``out`` (only if ``force``)."""
    out = Path(out).resolve()
    if out.exists() and not force:
        raise ExportError(f"{out} already exists: pass --force to replace it, or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_embedded(ref: CheckpointRef):
    """(model, tokenizer, training_info, config) of an embedded checkpoint; load errors name the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = validate_embedded(ref)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(ref.path / "model"), dtype="auto").eval()
    except Exception as exc:
        raise ExportError(f"{ref.path / 'model'}: cannot load the model with transformers ({exc})") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(ref.path / "tokenizer"))
    except Exception as exc:
        raise ExportError(f"{ref.path / 'tokenizer'}: cannot load the tokenizer ({exc})") from exc
    try:
        config = yaml.safe_load((ref.path / "config.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        raise ExportError(f"{ref.path / 'config.yaml'} is corrupted: not valid YAML ({exc})") from None
    return model, tokenizer, info, config


def model_card(info: dict, parity: ParityResult | None, source: Path, fp8: bool = False) -> str:
    bapo = info.get("bapo") or {}
    rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in bapo.items()) or "| (no BAPO block recorded) | |"
    quant = ("\nWeights of the linear layers are FP8 (e4m3) with per-tensor scales, quantised after training with "
             "NVIDIA ModelOpt (`quant_method: modelopt`); serve with vLLM or TensorRT-LLM.\n" if fp8 else "")
    return f"""---
library_name: transformers
tags: [bapo, reinforcement-learning, grpo]
---
# {info.get('model_name', 'model')} trained with BAPO

Policy trained with BAPO (Balanced Policy Optimization with Adaptive Clipping, Xi et al., arXiv 2510.18927)
using bapo-nemo.
{quant}
## Source

| | |
|---|---|
| checkpoint | `{source}` |
| step | `{info.get('step')}` |
| MLflow run id | `{info.get('mlflow_run_id')}` |
| MLflow tracking URI | `{info.get('mlflow_tracking_uri')}` |
| config hash | `{info.get('config_hash')}` |

## BAPO settings

| setting | value |
|---|---|
{rows}

## Export parity check

{parity.summary() if parity else 'not checked: no reference log-probs were recorded at training time'}
"""


def export_embedded(ref: CheckpointRef, out: str | Path, force: bool = False,
                    parity_prompts: list[str] | None = None, progress=print) -> ExportResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer, info, _ = load_embedded(ref)
    progress(f"loaded {ref.path} (step {info.get('step')}, {sum(p.numel() for p in model.parameters()):,} parameters)")
    sequences = heldout_sequences(model, tokenizer, prompts=parity_prompts)
    reference = token_logprobs(model, sequences)
    with atomic_output_dir(out, force) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if (ref.path / "model" / "generation_config.json").is_file():
            shutil.copy2(ref.path / "model" / "generation_config.json", tmp / "generation_config.json")
        (tmp / "bapo_training_info.json").write_text(json.dumps(info, indent=2))

        # parity: reload the written directory exactly as a user would
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype="auto").eval()
        reloaded_tok = AutoTokenizer.from_pretrained(str(tmp))
        tokenizer_match = all(tokenizer(p)["input_ids"] == reloaded_tok(p)["input_ids"]
                              for p in representable_prompts(tokenizer, parity_prompts))
        parity = compare(reference, token_logprobs(reloaded, sequences), tolerance_for(model.dtype), tokenizer_match)
        progress(parity.summary())
        if not parity.passed:
            raise ExportError(f"export of {ref.path} failed its parity check ({parity.summary()}); nothing was "
                              "written. Check the transformers version used for training and export.")
        card = model_card(info, parity, ref.path)
        if type(reloaded_tok).__name__ != type(tokenizer).__name__:
            # transformers 5 forces the model type's tokenizer class for some types (qwen2 among them)
            note = (f"`AutoTokenizer` loads this directory as `{type(reloaded_tok).__name__}` (chosen by the model "
                    f"type), while training used `{type(tokenizer).__name__}`; the two can encode text differently "
                    "(spaces, characters outside the vocabulary). Load the training tokenizer exactly with "
                    "`PreTrainedTokenizerFast.from_pretrained(<this directory>)`.")
            progress(f"note: {note}")
            card += f"\n## Loading the tokenizer\n\n{note}\n"
        (tmp / "README.md").write_text(card)
    return ExportResult(Path(out).resolve(), parity, ref.path, info.get("step"), info.get("mlflow_run_id"))
