"""Supervised warm-up on reference solutions (cross-entropy on response tokens only), so that RL starts
from a policy that sometimes answers correctly. The result is cached in <output_dir>/warmup/."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bapo_nemo.embedded.data.tasks import TaskStream
from bapo_nemo.embedded.loop.evaluation import encode_prompt
from bapo_nemo.embedded.output.run_log import LOGGER
from bapo_nemo.tracking.redact import redact_nested

CACHE_DIR = "warmup"


def sft_batch(tokenizer, tasks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+solution+EOS ids, attention mask, and a [B, S-1] mask of response targets.
    A demonstration marked `cut_off` (a looping one, cut at the length limit) gets no EOS."""
    rows, prompt_lens = [], []
    for t in tasks:
        if t.solution is None:
            raise ValueError(
                f"task {t.prompt_id} has no 'solution': the warm-up needs reference solutions "
                "(add them to the JSONL rows, or set warmup.steps=0)"
            )
        prompt = encode_prompt(tokenizer, t.question)
        end = [] if t.meta.get("cut_off") else [tokenizer.eos_token_id]
        rows.append(prompt + tokenizer.encode(t.solution, add_special_tokens=False) + end)
        prompt_lens.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    target = torch.zeros((len(rows), width - 1))
    for i, (r, p) in enumerate(zip(rows, prompt_lens)):
        ids[i, : len(r)] = torch.tensor(r)
        attention[i, : len(r)] = 1
        target[i, p - 1 : len(r) - 1] = 1.0
    return ids, attention, target


def run_warmup(
    model, tokenizer, stream: TaskStream, cfg, device, progress: bool = True, should_stop=lambda: False
) -> dict[str, float]:
    """`cfg.steps` AdamW steps, linear learning-rate decay to 10%. Returns the final metrics;
    `warmup/steps` below `cfg.steps` means `should_stop()` ended it early (checked before every step, so
    a SIGTERM waits for one step, not for the whole warm-up)."""
    if cfg.steps == 0:
        return {"warmup/loss": float("nan"), "warmup/steps": 0.0}
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - 0.9 * s / cfg.steps)
    recent: list[float] = []
    bar = tqdm(range(cfg.steps), desc="warm-up (SFT)", disable=not progress, leave=False)
    for step in bar:
        if should_stop():
            bar.close()
            return {"warmup/loss": sum(recent) / len(recent) if recent else float("nan"), "warmup/steps": float(step)}
        ids, attention, target = (x.to(device) for x in sft_batch(tokenizer, stream.next(cfg.batch_size)))
        logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (token_loss * target).sum() / target.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
    return {"warmup/loss": sum(recent) / len(recent), "warmup/steps": float(cfg.steps)}


def cache_key(config_dict: dict) -> dict:
    """What the warm-up result depends on, as written to info.json (secrets redacted): the model, tasks,
    data and warm-up settings, the seed, where it runs and in which precision, and the files it reads (each
    by its absolute path, size and modification time, so a run elsewhere with a file of the same name, or
    an edited file, does not match). Looping demonstrations run to the response length limit."""
    key = {k: config_dict[k] for k in ("model", "task", "data", "warmup") if k in config_dict}
    key["seed"], key["model_name"] = config_dict["grpo"]["seed"], config_dict["policy"]["model_name"]
    key["device"], key["precision"] = config_dict["runtime"]["device"], config_dict["policy"]["precision"]
    if config_dict.get("warmup", {}).get("loop_rate"):
        key["loop_length"] = config_dict["partial_rollouts"]["max_response_tokens"]
    data, task = config_dict.get("data") or {}, config_dict.get("task") or {}
    paths = [key["model_name"], (data.get("train") or {}).get("data_path"),
             (data.get("validation") or {}).get("data_path"), task.get("train_file"), task.get("eval_file")]
    key["files"] = {p: _identity(Path(p).expanduser()) for p in paths if p and Path(p).expanduser().exists()}
    return redact_nested(key)


def _identity(path: Path) -> list:
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def load_cached(output_dir: Path, key: dict):
    """(model_dir, metrics) of a cached warm-up made with the same settings whose weights read, else None
    (a damaged cache is redone, not loaded)."""
    from bapo_nemo.embedded.output.checkpoint import weights_problem

    info = _cache_info(output_dir)
    if info is None or info.get("key") != json.loads(json.dumps(key)):
        return None
    problem = weights_problem(output_dir / CACHE_DIR / "model")
    if problem:
        logging.getLogger(LOGGER).warning(f"the cached warm-up in {output_dir / CACHE_DIR} is damaged ({problem}): "
                                          "redoing the warm-up")
        return None
    return output_dir / CACHE_DIR / "model", info["metrics"]


def _cache_info(output_dir: Path) -> dict | None:
    try:
        return json.loads((output_dir / CACHE_DIR / "info.json").read_text())
    except (OSError, ValueError):
        return None


def reuse_cached(output_dir: Path, key: dict, sources: list[Path]) -> Path | None:
    """Copy into `output_dir` the warm-up of another run made from the same inputs (`key`): one of
    `sources` (e.g. --compare-with's run), else a sibling of `output_dir` (runs/a beside runs/b). Returns
    the run it came from, or None. The copy is whole or absent (renamed into place), and checked again."""
    own = output_dir.resolve()
    siblings = sorted(p for p in own.parent.iterdir() if p.is_dir()) if own.parent.is_dir() else []
    wanted = json.loads(json.dumps(key))
    for source in dict.fromkeys([*(p.resolve() for p in sources), *siblings]):
        info = _cache_info(source)
        if source == own or info is None or info.get("key") != wanted or load_cached(source, key) is None:
            continue
        partial = own / f".{CACHE_DIR}.copy-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source / CACHE_DIR, partial)
        shutil.rmtree(own / CACHE_DIR, ignore_errors=True)  # a cache of other settings
        os.rename(partial, own / CACHE_DIR)
        if load_cached(output_dir, key) is not None:
            return source
    return None


def save_cache(output_dir: Path, key: dict, model, metrics: dict) -> None:
    cache = output_dir / CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True)
    from bapo_nemo.embedded.output.checkpoint import disk_full_is_named, save_model

    with disk_full_is_named(f"the warm-up cache {cache}", cache / "model"):
        save_model(model, cache / "model")
    # info.json last: its presence marks a usable cache.
    (cache / "info.json").write_text(json.dumps({"key": key, "metrics": metrics}, indent=2))


def find_cached(output_dir: Path, key: dict, sources: list[Path]):
    """((model_dir, metrics) or None, the run a reused cache came from or None): this run's own cache made
    from the same inputs, else another run's (`reuse_cached`)."""
    cached = load_cached(output_dir, key)
    if cached is not None:
        return cached, None
    source = reuse_cached(output_dir, key, sources)
    return (load_cached(output_dir, key), source) if source is not None else (None, None)


def outcome_line(steps: int, cached, reused_from: Path | None) -> str:
    """The run log's line on its warm-up."""
    if steps == 0:
        return "no warm-up (warmup.steps=0)"
    if reused_from is not None:
        from bapo_nemo.embedded.output.run_summary import shown_path

        return (f"reused the warm-up of {shown_path(reused_from)} ({steps} steps; the same model, tasks, warm-up "
                "settings, seed and input files)")
    return f"{'reused the cached warm-up' if cached is not None else 'warm-up done'} ({steps} steps)"
