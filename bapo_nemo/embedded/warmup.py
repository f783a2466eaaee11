"""Supervised warm-up on reference solutions (cross-entropy on response tokens only), so that RL starts
from a policy that sometimes answers correctly. The result is cached in <output_dir>/warmup/."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bapo_nemo.embedded.evaluation import encode_prompt
from bapo_nemo.embedded.run_log import LOGGER
from bapo_nemo.embedded.tasks import TaskStream
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
    """What the warm-up result depends on (looping demonstrations run to the response length limit), as
    written to info.json: secrets redacted."""
    key = {k: config_dict[k] for k in ("seed", "model", "task", "data", "warmup") if k in config_dict}
    if config_dict.get("warmup", {}).get("loop_rate"):
        key["loop_length"] = config_dict["rollout"]["partial"]["max_response_tokens"]
    return redact_nested(key)


def load_cached(output_dir: Path, key: dict):
    """(model_dir, metrics) of a cached warm-up made with the same settings whose weights read, else None
    (a damaged cache is redone, not loaded)."""
    from bapo_nemo.embedded.checkpoint import weights_problem

    info_path = output_dir / CACHE_DIR / "info.json"
    if not info_path.is_file():
        return None
    try:
        info = json.loads(info_path.read_text())
    except ValueError:
        return None
    if info.get("key") != json.loads(json.dumps(key)):
        return None
    problem = weights_problem(output_dir / CACHE_DIR / "model")
    if problem:
        logging.getLogger(LOGGER).warning(f"the cached warm-up in {output_dir / CACHE_DIR} is damaged ({problem}): "
                                          "redoing the warm-up")
        return None
    return output_dir / CACHE_DIR / "model", info["metrics"]


def save_cache(output_dir: Path, key: dict, model, metrics: dict) -> None:
    cache = output_dir / CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True)
    from bapo_nemo.embedded.checkpoint import disk_full_is_named, save_model

    with disk_full_is_named(f"the warm-up cache {cache}", cache / "model"):
        save_model(model, cache / "model")
    # info.json last: its presence marks a usable cache.
    (cache / "info.json").write_text(json.dumps({"key": key, "metrics": metrics}, indent=2))
