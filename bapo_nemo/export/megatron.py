"""NeMo-RL Megatron checkpoint -> Hugging Face, inside the NeMo-RL container (docs/export.md).

The same call as v0.7.0's `examples/converters/convert_megatron_to_hf.py` (Megatron-Bridge through
`community_import.export_model_from_megatron`), with `policy.hf_config_overrides` passed on (that script
reads `policy.hf_overrides`, a key the policy does not have). Parity is against the training-time
`step_<N>/parity_logprobs.json` (else reported as not checked, never as passed); FP8-trained checkpoints
are judged on the mean |dlogp| (`parity.criterion_for`).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bapo_nemo.export.checkpoint import CheckpointRef, ExportError
from bapo_nemo.export.hf import ExportResult, atomic_output_dir
from bapo_nemo.export.model_card import model_card, portable_info
from bapo_nemo.export.parity import compare, criterion_for, read_reference_logprobs, token_logprobs
from bapo_nemo.tracking.redact import redact_text


def hf_overrides(policy: dict) -> dict:
    """The policy's HF config overrides under either spelling (v0.7.0's key is ``hf_config_overrides``)."""
    return dict(policy.get("hf_config_overrides") or policy.get("hf_overrides") or {})


def trained_in_fp8(policy: dict) -> bool:
    """Transformer Engine FP8 training: the reference log-probs were computed by the FP8 forward."""
    megatron_cfg = policy.get("megatron_cfg") or {}
    return bool(megatron_cfg.get("enabled") and (megatron_cfg.get("fp8_cfg") or {}).get("enabled"))


def megatron_weights_path(step_dir: Path) -> Path:
    """``policy/weights`` or, when NeMo-RL wrote a Megatron ``iter_*`` directory inside it, the newest one."""
    weights = step_dir / "policy" / "weights"
    iters = sorted(p for p in weights.glob("iter_*") if p.is_dir())
    return iters[-1] if iters else weights


def read_nemo_config(step_dir: Path) -> dict:
    path = step_dir / "config.yaml"
    if not path.is_file():
        raise ExportError(f"{path} is missing: NeMo-RL writes the run config next to policy/weights")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ExportError(f"{path} is corrupted: not valid YAML ({exc})") from None
    if not isinstance(config, dict) or "policy" not in config or "model_name" not in config["policy"]:
        raise ExportError(f"{path}: no policy.model_name; this is not a NeMo-RL GRPO config")
    return config


def _import_exporter():
    try:
        from nemo_rl.models.megatron.community_import import export_model_from_megatron
    except (ImportError, RuntimeError) as exc:  # transformer-engine raises RuntimeError without CUDA
        from bapo_nemo.export.megatron_python import where_looked

        raise ExportError(
            "exporting a NeMo-RL Megatron checkpoint needs NeMo-RL v0.7.0 with Megatron-Bridge: run it inside "
            f"nvcr.io/nvidia/nemo-rl:v0.7.0 (import failed: {exc}; also looked for {where_looked()}; "
            "NEMO_RL_VENV_DIR and NEMO_RL_DIR move them)"
        ) from exc
    return export_model_from_megatron


def export_megatron(ref: CheckpointRef, out: str | Path, force: bool = False, progress=print) -> ExportResult:
    from transformers import AutoModelForCausalLM

    step_dir = ref.path
    config = read_nemo_config(step_dir)
    policy = config["policy"]
    weights = megatron_weights_path(step_dir)
    tokenizer_path = step_dir / "policy" / "tokenizer"
    tokenizer_source = str(tokenizer_path) if tokenizer_path.is_dir() else policy.get("tokenizer", {}).get(
        "name", policy["model_name"])
    export_model_from_megatron = _import_exporter()
    info = {"step": ref.step, "model_name": policy["model_name"], "bapo": (config.get("loss_fn") or {}).get("bapo"),
            **_saved_run(step_dir)}
    reference = read_reference_logprobs(step_dir)

    with atomic_output_dir(out, force, ref.path) as tmp:
        target = tmp / "hf"  # export_model_from_megatron refuses an existing directory
        progress(f"converting {weights} with Megatron-Bridge (overrides: {hf_overrides(policy) or 'none'})")
        export_model_from_megatron(hf_model_name=policy["model_name"], input_path=str(weights),
                                   output_path=str(target), hf_tokenizer_path=tokenizer_source,
                                   overwrite=False, hf_overrides=hf_overrides(policy), strict=True)
        for item in target.iterdir():
            item.rename(tmp / item.name)
        target.rmdir()
        if reference is None:
            parity = None
            progress(f"parity NOT CHECKED: {step_dir}/parity_logprobs.json was not recorded at training time")
        else:
            reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype="auto").eval()
            tolerance, criterion = criterion_for(trained_in_fp8(policy), reloaded.dtype)
            parity = compare(reference["logprobs"], token_logprobs(reloaded, reference["sequences"]),
                             tolerance, criterion=criterion)
            progress(parity.summary())
            if not parity.passed:
                raise ExportError(f"export of {step_dir} failed its parity check ({parity.summary()})")
        (tmp / "bapo_training_info.json").write_text(json.dumps(portable_info(info), indent=2))
        (tmp / "README.md").write_text(model_card(info, parity, step_dir))
    return ExportResult(Path(out).resolve(), parity, step_dir, ref.step, info.get("mlflow_run_id"))  # type: ignore[arg-type]


def _saved_run(step_dir: Path) -> dict:
    """MLflow run of the checkpoint, from ``<checkpoint_dir>/mlflow_run.json`` (bapo_nemo.tracking.nemo_rl)."""
    path = step_dir.parent / "mlflow_run.json"
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    # written redacted since bapo-nemo redacts what it writes; an older file may hold the password
    uri = saved.get("tracking_uri")
    return {"mlflow_run_id": saved.get("run_id"), "mlflow_tracking_uri": redact_text(uri) if uri else None}
