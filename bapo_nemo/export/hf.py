"""Embedded checkpoint -> Hugging Face directory (safetensors, config, generation config, tokenizer, model
card), written into a temporary sibling directory and renamed into place only after the parity check
passed, so a failed or interrupted export never leaves a half-written directory behind. What stands at
--out is checked again at the rename, under a lock that exports into one directory share: a directory that
appeared there meanwhile (another export's, or anything else) is never replaced without --force."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bapo_nemo.embedded.run.prompt_format import response_tokens
from bapo_nemo.export.checkpoint import CheckpointRef, ExportError, validate_embedded
from bapo_nemo.export.model_card import model_card, portable_info
from bapo_nemo.export.parity import (
    ParityResult,
    compare,
    heldout_sequences,
    representable_prompts,
    token_logprobs,
    tolerance_for,
)
from bapo_nemo.tracking.redact import redact_nested


@dataclass
class ExportResult:
    out_dir: Path
    parity: ParityResult
    source: Path
    step: int | None
    run_id: str | None
    extra: dict = field(default_factory=dict)


# Written into every export; `--force` replaces only a directory holding it (never a run, a checkpoint,
# or a directory of other files that happens to be named like the --out).
EXPORT_MARKER = "BAPO_EXPORT"


def run_root(source: Path) -> Path:
    """The directory a checkpoint belongs to: an embedded run's output_dir, or NeMo-RL's checkpoint_dir."""
    source = source.resolve()
    if source.parent.name == "checkpoints":
        return source.parent.parent
    return source.parent if source.name.startswith("step_") else source


def check_output_dir(out: Path, force: bool, source: Path | None) -> None:
    """Refuse an --out that would destroy the source run or anything that is not a previous export."""
    if source is not None:
        root = run_root(source)
        if out == root or out in root.parents or out == source.resolve() or out in source.resolve().parents:
            raise ExportError(f"--out {out} is or contains the checkpoint being exported ({source}): choose a "
                              "directory outside the run, e.g. --out exports/<name>")
        if root in out.parents and out.exists():
            raise ExportError(f"--out {out} is inside the training run {root} and already exists: choose a new "
                              "directory (nothing was replaced)")
    if not out.exists():
        return
    if not force:
        raise ExportError(f"{out} already exists: pass --force to replace it, or choose another --out")
    if not out.is_dir() or not (out / EXPORT_MARKER).is_file():
        raise ExportError(f"{out} exists and is not a previous bapo-nemo export (no {EXPORT_MARKER} marker), so "
                          "--force will not replace it: choose another --out, or delete it yourself")


@contextmanager
def atomic_output_dir(out: str | Path, force: bool, source: Path | None = None):
    """Yield a temp dir next to ``out``; on success it gets the export marker and replaces ``out`` (an
    existing ``out`` only with ``force`` and only if it is a previous export)."""
    out = Path(out).resolve()
    check_output_dir(out, force, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        (tmp / EXPORT_MARKER).write_text(f"bapo-nemo export of {source}\n" if source else "bapo-nemo export\n")
        respect_umask(tmp)
        with _exports_take_turns(out.parent):
            existed = out.exists()
            try:
                check_output_dir(out, force, source)  # again: the export took a while
            except ExportError as exc:
                raise ExportError(f"{out} appeared while this export ran (another export into it, or another "
                                  f"process), and this export was discarded: {exc}") from None
            if existed:  # a previous export, and --force
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.replace(out, old)
                os.replace(tmp, out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, out)  # fails rather than replace a directory with files in it
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _exports_take_turns(parent: Path):
    """An flock on the directory that holds --out: exports into it check and rename one at a time."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def respect_umask(root: Path) -> None:
    """Give a written tree the permissions of the user's umask: mkdtemp and HF's atomic saves create
    0700/0600, which hides exports from teammates on a shared filesystem."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for path in root.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


class CheckpointVanished(ExportError):
    """The checkpoint was deleted while it was read (a run still training prunes its older checkpoints)."""


def load_embedded(ref: CheckpointRef):
    """(model, tokenizer, training_info, config) of an embedded checkpoint, all in memory; load errors name
    the file, and a checkpoint deleted meanwhile raises CheckpointVanished."""
    try:
        return _load_embedded(ref)
    except (ExportError, OSError) as exc:
        if ref.path.exists():
            raise
        raise CheckpointVanished(
            f"{ref.path} was deleted while it was read: the run that owns it still trains and deletes its older "
            f"checkpoints (checkpointing.keep_top_k). Export the run directory {run_root(ref.path)} to get its newest "
            "checkpoint, or wait until the run finishes"
        ) from exc


def _load_embedded(ref: CheckpointRef):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = redact_nested(validate_embedded(ref))  # written into the export and its model card
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


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The embedded trainer's prompt encoding: BOS, then the text's tokens (spaces included)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def save_round_trip_tokenizer(tokenizer, out: Path) -> None:
    """Save ``tokenizer`` so that ``AutoTokenizer.from_pretrained(out)(text)`` gives :func:`prompt_ids`
    (embedded/model/tokenizer.py, `save_inference_tokenizer`: a BOS-prepending post-processor, and an ``auto_map``
    entry so that transformers 5 does not swap in ``Qwen2Tokenizer`` for a qwen2 config, which drops spaces).
    A chat template set on ``tokenizer`` is saved with it."""
    from bapo_nemo.embedded.model.tokenizer import save_inference_tokenizer

    save_inference_tokenizer(tokenizer, out)


def prompting_of(model, tokenizer, config: dict, info: dict):
    """(the run's prompt format, a held-out example of it, the model's greedy response to the example): the
    example the trainer recorded, or for an older checkpoint of the bundled tasks one of their format."""
    from bapo_nemo.embedded.run.prompt_format import BUNDLED_EXAMPLE, greedy_response, prompt_format

    fmt = prompt_format(tokenizer, config)
    example = info.get("example") or (BUNDLED_EXAMPLE if fmt.bundled else {"question": "What is 17 + 25?"})
    return fmt, example, greedy_response(model, fmt, example["question"], response_tokens(config))


def export_embedded(ref: CheckpointRef, out: str | Path, force: bool = False,
                    parity_prompts: list[str] | None = None, progress=print) -> ExportResult:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer, info, config = load_embedded(ref)
    progress(f"loaded {ref.path} (step {info.get('step')}, {sum(p.numel() for p in model.parameters()):,} parameters)")
    sequences = heldout_sequences(model, tokenizer, prompts=parity_prompts)
    reference = token_logprobs(model, sequences)
    fmt, example, response = prompting_of(model, tokenizer, config, info)
    with atomic_output_dir(out, force, ref.path) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        save_round_trip_tokenizer(fmt.tokenizer, tmp)
        try:  # the file as trained (save_pretrained wrote the loaded copy, in case a pruning removed it since)
            shutil.copy2(ref.path / "model" / "generation_config.json", tmp / "generation_config.json")
        except FileNotFoundError:
            pass
        (tmp / "bapo_training_info.json").write_text(json.dumps(portable_info(info), indent=2))

        # parity: reload the written directory exactly as a user would; its tokenizer must encode each
        # prompt as the trainer did (BOS, spaces) through the plain AutoTokenizer call, and its chat template
        # must build the trainer's prompt from a question
        reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype="auto").eval()
        reloaded_tok = AutoTokenizer.from_pretrained(str(tmp))
        questions = representable_prompts(tokenizer, parity_prompts) + [example["question"]]
        tokenizer_match = (all(prompt_ids(tokenizer, p) == reloaded_tok(p)["input_ids"] for p in questions + [" 7 + 5 ?"])
                           and all(fmt.chat_ids(reloaded_tok, q) == fmt.training_ids(tokenizer, q) for q in questions))
        parity = compare(reference, token_logprobs(reloaded, sequences), tolerance_for(model.dtype), tokenizer_match)
        progress(parity.summary())
        if not parity.passed:
            raise ExportError(f"export of {ref.path} failed its parity check ({parity.summary()}); nothing was "
                              "written. Check the transformers version used for training and export.")
        card = model_card(info, parity, ref.path, prompting=fmt.section(example, response_tokens(config), response))
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
