"""The policy: the tiny Qwen2-architecture model built from a config (no download), or any pretrained
causal LM (`policy.model_name`), and how it is placed on its device (dtype, bf16 autocast, gradient
checkpointing)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from bapo_nemo.embedded.model.attention import use_gqa_sdpa


def build_model(model_cfg, tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2 causal LM sized by `model_cfg` (see `ModelConfig`)."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rope_theta=model_cfg.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Initialisation draws from the global RNG: fork it so model init does not shift other streams.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def token_logprobs_and_entropy(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each next token under `model` and the policy entropy at that position.

    input_ids, attention_mask: [B, S] right-padded. Returns ([B, S-1], [B, S-1]); position t scores
    token t+1.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    token_lp = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return token_lp, entropy


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """`policy.model_name` does not name a loadable causal LM; the message says what was found."""


EXAMPLE_HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def model_path_problem(name: str) -> str | None:
    """What is wrong with `policy.model_name`, as far as the filesystem tells without loading anything: a
    directory without config.json, or a value that can only be a path (it is not a valid hub id: it starts
    with / ./ ../ ~, or has more than one /) and does not exist. None: it may load."""
    path = Path(name).expanduser()
    if path.exists():
        if (path / "config.json").is_file():
            return None
        return (f"policy.model_name={name!r}: {path} is not a model directory (no config.json); point it at a "
                "directory written by save_pretrained, or a hub id")
    if is_hub_id(name):
        return None  # a hub id, or a local path with a typo: only loading tells
    return (f"policy.model_name={name!r}: no such directory ({path.resolve()} does not exist{_models_near(path)}): "
            f"point it at a directory written by save_pretrained, or at a hub id such as {EXAMPLE_HUB_ID}")


def is_hub_id(name: str) -> bool:
    """Whether `name` has the form of a Hugging Face hub id (`org/name` or `name`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _models_near(path: Path) -> str:
    """The model directories in the deepest existing parent of a missing `path` (a typo's likely target)."""
    parent = path.resolve().parent
    while not parent.is_dir():
        parent = parent.parent
    try:
        models = sorted(p.name for p in parent.iterdir() if (p / "config.json").is_file())
    except OSError:
        return ""
    if not models:
        return ""
    shown = ", ".join(models[:5]) + (" ..." if len(models) > 5 else "")
    return f"; model directories in {parent}: {shown}"


def load_pretrained(name: str, dtype: str, local_only: bool = False):
    """`AutoModelForCausalLM.from_pretrained(name)` in `dtype`. A local directory must hold a model
    (config.json), a path must exist (`model_path_problem`); anything else is taken as a hub id, which needs
    the network (`local_only`: the Hugging Face cache only)."""
    from transformers import AutoModelForCausalLM

    problem = model_path_problem(name)
    if problem is not None:
        raise ModelLoadError(problem)
    path = Path(name).expanduser()
    try:
        if path.exists():
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
        return AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES[dtype], local_files_only=local_only)
    except (OSError, ValueError) as exc:
        if path.exists():
            raise ModelLoadError(f"policy.model_name={name!r}: cannot load a causal LM from the local directory: "
                                 f"{str(exc).splitlines()[0]}") from None
        raise ModelLoadError(_hub_failure(name, local_only, exc)) from None


def _hub_failure(name: str, local_only: bool, exc: Exception) -> str:
    """A hub id that did not load: the ways to run offline first, then what the hub said (it may also be a
    mistyped local directory)."""
    from bapo_nemo.embedded.model.hub import offline_fix

    why = ("the Hugging Face hub is not reachable from here and it is not in the local cache" if local_only else
           "it did not load from the Hugging Face hub")
    return (f"policy.model_name={name!r}: {why}; {offline_fix(name)} (no local directory "
            f"{Path(name).expanduser().resolve()} either; the hub said: {str(exc).splitlines()[0]})")


def hub_cache_only(name: str) -> bool:
    """Whether a hub id `name` must come from the local cache: HF_HUB_OFFLINE is set, or one short probe
    finds the hub unreachable (so loading fails at once instead of after a minute of retries)."""
    from bapo_nemo.embedded.model.hub import hub_offline_by_setting, hub_reachable

    if Path(name).expanduser().exists():
        return False
    return hub_offline_by_setting() or not hub_reachable()


def load_policy(cfg, device: torch.device) -> tuple[Any, Any, int]:
    """(model on its device, tokenizer, context window in tokens) of a run config: `policy.model_name`
    loaded with its own tokenizer, or the tiny Qwen2 built from config with the bundled character tokenizer."""
    from bapo_nemo.embedded.model.bundled_model import bundled_problem, is_bundled, load_bundled
    from bapo_nemo.embedded.model.tokenizer import load_tokenizer

    if is_bundled(cfg.policy.model_name):
        if (problem := bundled_problem(cfg.policy.model_name)) is not None:
            raise ModelLoadError(problem)
        model, tokenizer = load_bundled(cfg.policy.model_name, DTYPES[cfg.model.dtype])
        tokenizer = ready_tokenizer(tokenizer, cfg.policy.model_name)
        window = model.config.max_position_embeddings
    elif cfg.policy.model_name is not None:
        local_only = hub_cache_only(cfg.policy.model_name)
        model = load_pretrained(cfg.policy.model_name, cfg.model.dtype, local_only)
        tokenizer = load_pretrained_tokenizer(cfg.policy.model_name, local_only)
        check_tokenizer_fits(model, tokenizer, cfg.policy.model_name)
        window = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    else:
        tokenizer = load_tokenizer()
        model = build_model(cfg.model, tokenizer, cfg.grpo.seed)
        window = cfg.model.max_position_embeddings
    return prepare_policy(cfg, model, device), tokenizer, int(window)


def prepare_policy(cfg, model, device: torch.device):
    """`prepare_model` with a run config's settings (for the loaded policy and every copy read from disk)."""
    return prepare_model(model, device, cfg.model.dtype, cfg.policy.precision,
                         cfg.policy.dtensor_cfg.activation_checkpointing)


def prepare_model(model, device: torch.device, dtype: str, precision: str, gradient_checkpointing: bool):
    """Move `model` to `device` and `dtype`, then: grouped-query attention without repeated KV heads
    (`use_gqa_sdpa`), gradient checkpointing (activations recomputed in the backward pass) and, with
    precision bfloat16, bf16 autocast around `forward` (the callers take fp32 log-probs of the logits).
    Applied again to every copy loaded from disk (resume, warm-up cache): none of these is saved with it."""
    model = model.to(device=device, dtype=DTYPES[dtype])
    use_gqa_sdpa(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if precision == "bfloat16":
        forward = model.forward

        @functools.wraps(forward)
        def autocast_forward(*args, **kwargs):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return forward(*args, **kwargs)

        model.forward = autocast_forward
    return model


def load_pretrained_tokenizer(name: str, local_only: bool = False):
    """`AutoTokenizer.from_pretrained(name)` (the tokenizer of `policy.model_name`), left-padded. A tokenizer
    without a pad token pads with its EOS token (padding is always masked out); one without either is
    an error."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"policy.model_name={name!r}: cannot load its tokenizer: {str(exc).splitlines()[0]}"
        ) from None
    return ready_tokenizer(tokenizer, name)


def ready_tokenizer(tokenizer, name: str):
    """`tokenizer` left-padded, padding with EOS where it has no pad token; one without EOS is an error."""
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(
            f"policy.model_name={name!r}: the tokenizer has no EOS token, so responses cannot end; "
            "set eos_token in its tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        print(
            f"policy.model_name={name!r}: the tokenizer has no pad token; padding with EOS "
            f"{tokenizer.eos_token!r}"
        )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def check_tokenizer_fits(model, tokenizer, name: str) -> None:
    """At start-up, a tokenizer the model can use: it encodes text at all (a model directory without
    tokenizer files loads an empty one, and training fails later on "a tensor of 0 elements"), and every id
    it produces has a row in the model's embedding (else an IndexError in the first forward)."""
    if not tokenizer.encode("1 + 2 = 3", add_special_tokens=False):
        raise ModelLoadError(
            f"policy.model_name={name!r}: its tokenizer encodes text as nothing (no tokenizer files in {name}?): "
            "save the model's tokenizer beside it with tokenizer.save_pretrained(...)"
        )
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"policy.model_name={name!r}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has "
            f"{rows} rows, so tokens {rows} and up have none: use the tokenizer the model was trained with, or "
            "resize the model (model.resize_token_embeddings(len(tokenizer))) and save it again"
        )
