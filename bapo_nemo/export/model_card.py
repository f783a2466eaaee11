"""The model card (README.md) of an export: what was trained, from which run, with which BAPO settings,
how to prompt it, and the parity check. It travels with the model to other machines and the hub, so it
holds no path of the machine that exported it: a local model name or checkpoint shows as its last parts,
a local MLflow store by its file name (`bapo_training_info.json` beside it is scrubbed the same way)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from bapo_nemo.export.parity import ParityResult


def model_card(info: dict, parity: ParityResult | None, source: Path, fp8: bool = False,
               prompting: str | None = None) -> str:
    """`info`: the checkpoint's training_info (redacted); `prompting`: the section on prompting, if known."""
    info = portable_info(info)
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
{prompting.rstrip() + chr(10) + chr(10) if prompting else ""}## Source

| | |
|---|---|
| checkpoint | `{checkpoint_name(source)}` |
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


def portable_info(info: dict) -> dict:
    """training_info without local paths: a model directory by its name, a sqlite or file store by its
    file name (a server's URI stays: it is no path of this machine, and its password is already redacted)."""
    out = dict(info)
    if out.get("model_name"):
        out["model_name"] = local_name(str(out["model_name"]))
    uri = out.get("mlflow_tracking_uri")
    scheme = urlparse(uri).scheme if uri else None
    if uri and scheme in ("sqlite", "file", ""):
        out["mlflow_tracking_uri"] = f"{scheme or 'file'}:///<training run>/{Path(urlparse(uri).path or uri).name}"
    return out


def local_name(name: str) -> str:
    """A model name as a card shows it: a local directory (one that exists here, or a name that can only be a
    path) by its last component; a hub id as it is."""
    from bapo_nemo.embedded.model.policy import is_hub_id

    path = Path(name).expanduser()
    return path.name if path.exists() or not is_hub_id(name) else name


def checkpoint_name(source: Path) -> str:
    """`<run>/checkpoints/step_<N>` (embedded) or `<checkpoint_dir>/step_<N>` (NeMo-RL), never the full path."""
    source = Path(source)
    parts = source.parts[-3:] if source.parent.name == "checkpoints" else source.parts[-2:]
    return "/".join(parts)
