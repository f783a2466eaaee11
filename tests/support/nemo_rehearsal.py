"""What the CPU rehearsals of the cluster path share (tests/nemo_rl/test_megatron_rehearsal.py, TP 2 x CP 2 x
DP 2; tests/nemo_rl/test_async_rehearsal.py, the async loop at CP 2; tests/nemo_rl/test_fault_rehearsal.py, the faults at
DP 2): a shipped preset changed only in sizes, the tiny model and data they run on, the driver run in a
process of its own (tests/support/nemo_megatron_rehearsal_run.py), the workers' records read back, and the check
that every loss call clipped with the search over its optimizer step's tokens."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from filelock import FileLock, Timeout

from tests.support.nemo_tiny_config import data_env_logger
from tests.support.ray_head import share_the_session_zygote

REPO = Path(__file__).resolve().parents[2]


# ---- a shipped preset at a rehearsal's sizes -----------------------------------------------------------
def load_preset(path: Path) -> dict:
    """A shipped config as NeMo-RL's driver loads it (defaults chain, interpolations resolved)."""
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    return OmegaConf.to_container(load_config(str(path)), resolve=True)


def scaled_partial_rollouts(preset: dict, *, response_cap: int, prompts: int, generations: int) -> dict:
    """A loaded preset's partial-rollout block at a rehearsal's sizes: the token budget cut so that the
    longest response takes as many segments as in the preset (4 for the 64k preset: 2 tokens of 8), the
    other lengths tiny, counts of prompts scaled to the rehearsal's prompts per step; the staleness rule,
    the resumptions and the prefill pool as shipped."""
    block = preset["partial_rollouts"]
    scaled = dict(block)
    segments = math.ceil(preset["policy"]["generation"]["max_new_tokens"] / block["token_budget"])
    scaled["token_budget"] = math.ceil(response_cap / segments)
    if scaled.get("max_response_tokens") is not None:
        scaled["max_response_tokens"] = response_cap
    if scaled.get("global_token_budget") is not None:
        scaled["global_token_budget"] = 2 * prompts * generations * scaled["token_budget"]
    for key in ("max_in_flight_groups", "prompts_per_iteration"):
        if scaled.get(key) is not None:
            scaled[key] = max(prompts, 1)
    return scaled


def sized_overrides(root: Path, assets: dict, preset: Path, *, layout: tuple[int, int, int], prompts: int,
                    generations: int, global_batch: int, sequence: int, response_cap: int, steps: int) -> dict:
    """What a CPU rehearsal changes in a shipped preset: sizes only -- the model, lengths, batch sizes, the
    parallel layout (TP, CP, DP), step counts and paths. Also (each says why): precision float32 (the loss
    and gradient comparisons are exact to ~1e-6; bf16/FP8 numerics are the GPU's), a learning rate a tiny
    model moves visibly with in a few steps (the preset's 1e-6 would leave every ratio at 1), no warm-up, no
    validation (AIME is not here). FP8 stays configured: NeMo-RL's packing pads micro-batches for it as on
    the cluster."""
    tp, cp, dp = layout
    model = str(assets["model"])
    overrides = {
        "defaults": str(preset),
        "grpo": {
            "num_prompts_per_step": prompts, "num_generations_per_prompt": generations,
            "max_num_steps": steps, "val_period": 0, "val_at_start": False, "val_at_end": False,
        },
        "checkpointing": {"checkpoint_dir": str(root / "checkpoints"), "metric_name": None},
        "policy": {
            "model_name": model,
            "tokenizer": {"name": model},
            "train_global_batch_size": global_batch,
            "max_total_sequence_length": sequence,
            "make_sequence_length_divisible_by": 2 * cp * tp,
            "precision": "float32",
            "megatron_cfg": {
                "tensor_model_parallel_size": tp,
                "context_parallel_size": cp,
                "optimizer": {"lr": 1.0e-2, "min_lr": 1.0e-2, "bf16": False},
                "scheduler": {"lr_warmup_iters": 0, "lr_decay_iters": 100},
            },
            "generation": {"max_new_tokens": response_cap},
        },
        # as the preset: prompt + response cap = sequence
        **data_env_logger(assets, root / "logs", "rehearsal", max_input_seq_length=sequence - response_cap),
        "cluster": {"gpus_per_node": tp * cp * dp, "num_nodes": 1},
    }
    if async_checkpoint_saves():  # NeMo-RL main: the workers' saves go on after save_checkpoint returns
        overrides["policy"]["megatron_cfg"]["checkpoint"] = {"async_save": True}
    return overrides


def async_checkpoint_saves() -> bool:
    """Whether the installed NeMo-RL finalises checkpoints after asynchronous Megatron saves (main: its
    Policy has `finalize_async_save`, grpo's `begin_finalization` waits for it before the rename)."""
    from nemo_rl.models.policy.lm_policy import Policy

    return hasattr(Policy, "finalize_async_save")


# ---- the run ---------------------------------------------------------------------------------------------
# The NeMo-RL tiers of several trees run at once (tests/suite.sh), after the package's tiers. Two rehearsals
# fit the machine's memory side by side (an async one is ~7 GB of Ray actors), the Megatron one (~9 GB) only
# alone: a rehearsal takes one of two slots, machine-wide, the Megatron one both.
REHEARSAL_SLOTS = [Path(tempfile.gettempdir()) / f"bapo-nemo-rehearsal-slot-{i}.lock" for i in range(2)]


@contextmanager
def rehearsal_slots(count: int):
    """Hold `count` of the machine's rehearsal slots (all of them when it asks for more) while the block runs."""
    with ExitStack() as held:
        if count >= len(REHEARSAL_SLOTS):
            for path in REHEARSAL_SLOTS:  # always in this order: two takers of both never deadlock
                held.enter_context(FileLock(str(path)))
        else:
            while not _take_a_free_slot(held):
                time.sleep(1)
        yield


def _take_a_free_slot(held: ExitStack) -> bool:
    for path in REHEARSAL_SLOTS:
        lock = FileLock(str(path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue
        held.callback(lock.release)
        return True
    return False



def rehearsal_assets(root: Path, *, sequence: int) -> dict:
    """The tiny LM (warm-started, positions for `sequence` tokens), the training prompts and the MLflow
    store a rehearsal runs on."""
    from tests.support.nemo_vllm_standins import write_answer_jsonl, write_rehearsal_model

    return {
        "model": write_rehearsal_model(root / "tiny_lm", positions=sequence),
        "train": write_answer_jsonl(root / "train.jsonl", 256),
        "mlflow": f"sqlite:///{root / 'mlflow.db'}",
    }


def engine_rehearsal_assets(root: Path) -> dict:
    """A rehearsal on megatron-core's GPTModel and the real vLLM engine: the warm-started tiny Qwen2 (an HF
    checkpoint; the driver e2e tests' model), its sum prompts and the MLflow store."""
    from tests.support.nemo_cpu_standins import write_math_jsonl, write_tiny_model

    return {
        "model": write_tiny_model(root / "tiny_qwen2"),
        "train": write_math_jsonl(root / "train.jsonl"),
        "mlflow": f"sqlite:///{root / 'mlflow.db'}",
    }


def run_rehearsal(root: Path, assets: dict, config: Path, info: dict, spec: dict, guard_s: float) -> dict:
    """The driver run(s) `spec` asks for on `config` (tests/support/nemo_megatron_rehearsal_run.py, in a process of its own);
    their record, as load_rehearsal reads it."""
    (root / "spec.json").write_text(json.dumps({"config": str(config), "root": str(root), **spec}))
    log = root / "driver.log"
    share_the_session_zygote()
    with log.open("w") as out, rehearsal_slots(spec.get("slots", 1)):
        done = subprocess.run([sys.executable, "-m", "tests.support.nemo_megatron_rehearsal_run", str(root / "spec.json")],
                              cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=guard_s, check=False)
    assert done.returncode == 0, f"the rehearsal's driver process failed ({log}):\n{log.read_text()[-5000:]}"
    summary = json.loads((root / "runs.json").read_text())
    (root / "rehearsal.json").write_text(json.dumps({
        **summary, "info": info, "config": str(config), "assets": {k: str(v) for k, v in assets.items()},
    }))
    return load_rehearsal(root)


def load_rehearsal(root: Path) -> dict:
    """A finished rehearsal's record (also to inspect one by hand: load_rehearsal(Path(...)))."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    summary = json.loads((root / "rehearsal.json").read_text())
    calls = torch.load(root / "driver_calls.pt", weights_only=False)
    return {
        "root": root, "record": root / "record", "config": load_preset(Path(summary["config"])),
        "info": summary["info"], "assets": summary["assets"], "runs": summary["runs"],
        "checkpoints_after_stop": summary["checkpoints_after_stop"],
        "calls": {"train": [BatchedDataDict(b) for b in calls["train"]],
                  "get_logprobs": [(BatchedDataDict(d), BatchedDataDict(r)) for d, r in calls["get_logprobs"]],
                  "logprob_calls_before_train": calls["logprob_calls_before_train"]},
    }


# ---- reading the records back ----------------------------------------------------------------------------
def policy_records(record_dir: Path) -> dict[int, list[dict]]:
    """rank -> that rank's records in the order they were written (across all runs)."""
    out = {}
    for directory in sorted((record_dir / "policy").glob("rank*")):
        rank = int(directory.name[4:])
        out[rank] = [torch.load(p, weights_only=False) for p in sorted(directory.glob("*.pt"))]
    return out


def of_kind(records: list[dict], kind: str) -> list[dict]:
    return [r for r in records if r["kind"] == kind]


def at(records: dict[int, list[dict]], **coords) -> list[list[dict]]:
    """The records of the ranks at these coordinates (e.g. tp=0, cp=0), one list per rank, by DP rank."""
    picked = [(recs[0]["coords"], recs) for recs in records.values()
              if all(recs[0]["coords"][k] == v for k, v in coords.items())]
    return [recs for c, recs in sorted(picked, key=lambda x: (x[0]["dp"], x[0]["cp"], x[0]["tp"]))]


def joined(records: dict[int, list[dict]], kind: str, index: int, field: str) -> dict[str, torch.Tensor]:
    """`field` of the (dp 0, cp 0) ranks' `index`-th record of `kind`, their TP shards joined into one
    process's tensors (the tiny LM's; megatron-core's GPTModel runs at TP 1 only: its one shard is whole)."""
    from tests.support.nemo_vllm_standins import join_tp_shards

    shards = [of_kind(recs, kind)[index][field] for recs in at(records, dp=0, cp=0)]
    return shards[0] if len(shards) == 1 else join_tp_shards(shards)


def weights_of(records: dict[int, list[dict]], kind: str, index: int) -> dict[str, torch.Tensor]:
    """One-process weights from the (dp 0, cp 0) ranks' `index`-th record of `kind`."""
    return joined(records, kind, index, "params")


def grads_of(records: dict[int, list[dict]], index: int) -> dict[str, torch.Tensor]:
    """One-process reduced gradients of the `index`-th optimizer step."""
    return joined(records, "grads", index, "grads")


def optimizer_steps(rehearsal) -> list[dict]:
    """Per optimizer step (every run, in order): the batch the driver handed Policy.train (bounds
    attached), the log-probs the driver searched those bounds with, every rank's train record, and the
    one-process weights before the step."""
    records = policy_records(rehearsal["record"])
    driver_batches = rehearsal["calls"]["train"]
    searched = searched_logprobs(driver_batches, rehearsal["calls"]["get_logprobs"],
                                 rehearsal["calls"]["logprob_calls_before_train"])
    steps = []
    for k, batch in enumerate(driver_batches):
        per_rank = {rank: of_kind(recs, "train")[k] for rank, recs in records.items()}
        steps.append({"batch": batch, "ranks": per_rank, "weights": weights_of(records, "grads", k),
                      "grads": grads_of(records, k), "records": records, "index": k,
                      "searched_logprobs": searched[k]})
    return steps


def searched_logprobs(train_batches: list, logprob_calls: list, calls_before_train: list[int]) -> list[torch.Tensor]:
    """The current policy's log-probs the driver searched each optimizer step's bounds with: the step's
    own extra get_logprobs pass over exactly its rows, made right before its train() (a later step of a
    rollout batch), else its `prev_logprobs` (the first step: grpo computed them at these weights just
    before train()). Matched by place, not by content alone: two steps of one rollout batch can hold
    the same rows (one prompt drawn twice, its responses alike), and the later one's pass is made at
    weights the earlier one's step changed."""
    out = []
    for batch, before in zip(train_batches, calls_before_train, strict=True):
        current = batch["prev_logprobs"]
        if before > 0 and same_sequences(logprob_calls[before - 1][0], batch):
            result = logprob_calls[before - 1][1]
            width = result["logprobs"].shape[1]  # Policy.train pads the batch it was handed in place
            current = torch.zeros_like(batch["prev_logprobs"])
            current[:, :width] = result["logprobs"]
        out.append(current)
    return out


def same_sequences(a, b) -> bool:
    """Whether two batches hold the same rows (lengths and tokens), whatever their padded widths."""
    if not torch.equal(a["input_lengths"], b["input_lengths"]):
        return False
    return all(torch.equal(a["input_ids"][i, :n], b["input_ids"][i, :n]) for i, n in enumerate(a["input_lengths"].tolist()))


# ---- the bounds every loss call clipped with ----------------------------------------------------------
def bapo_options(config: dict):
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig

    from bapo_nemo.nemo.loss import bapo_options_from_loss_config

    return bapo_options_from_loss_config(ClippedPGLossConfig(**config["loss_fn"]))


def search_over(batch: dict, current_logprobs: torch.Tensor, options) -> object:
    """search_clip_bounds over a batch's tokens, computed here from its columns (the loss's rule: ratio
    against the behaviour or proximal log-probs, masked by token and sample masks), in the columns' own
    precision as the driver computes it: where a step's share sits on the target in exact arithmetic (the
    first step, every ratio 1), a rounding of the inputs decides whether the search moves."""
    from bapo_nemo.algorithm import search_clip_bounds
    from bapo_nemo.algorithm.bapo import importance_ratio

    mask = batch["token_mask"][:, 1:] * batch["sample_mask"].unsqueeze(-1)
    reference = batch["generation_logprobs" if options.ratio_reference == "behavior" else "prev_logprobs"]
    ratio = importance_ratio(current_logprobs[:, 1:], reference[:, 1:])
    return search_clip_bounds(ratio, batch["advantages"][:, 1:], mask, options.bapo)


def reference_logprobs(weights: dict, batch: dict) -> torch.Tensor:
    """The tiny LM's log-probs of a batch in one process (positions 0.. per row, as unpacked)."""
    from tests.support.nemo_vllm_standins import token_logprobs

    return token_logprobs(weights, batch["input_ids"])


def qwen2_reference(model_dir: str):
    """`reference_logprobs` for a rehearsal whose policy is megatron-core's GPTModel holding a Qwen2: HF
    transformers' Qwen2 at the policy's weights, converted to HF names as the refit converts them."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    from tests.support.megatron_gpt import hf_from_megatron

    config = AutoConfig.from_pretrained(model_dir)
    model = Qwen2ForCausalLM(config).eval()

    def logprobs(weights: dict, batch: dict) -> torch.Tensor:
        model.load_state_dict(hf_from_megatron(weights, config))
        ids = batch["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)

    return logprobs


# The trainer's log-probs (packed, split over TP/CP ranks) against the one-process tiny LM, float32.
LOGPROB_TOLERANCE = 1e-5


def check_bounds_of_every_step(steps: list[dict], options, reference=reference_logprobs, some_step_moves: bool = True) -> None:
    """Every loss call of every optimizer step (optimizer_steps) clipped with the search over that step's
    batch and the log-probs the driver searched with, and those are the one-process model's (`reference`:
    the tiny LM, or qwen2_reference) at the weights before the step; with `some_step_moves`, some step
    searched away from the starting bounds."""
    moved, worst = 0, 0.0
    for step in steps:
        batch, current = step["batch"], step["searched_logprobs"]
        mask = (batch["token_mask"] * batch["sample_mask"].unsqueeze(-1))[:, 1:].bool()
        gap = (current - reference(step["weights"], batch))[:, 1:][mask].abs()
        worst = max(worst, float(gap.max()) if gap.numel() else 0.0)
        expected = search_over(batch, current, options)
        moved += (expected.c_low, expected.c_high) != (options.bapo.c_low_min, options.bapo.c_high_min)
        for rank, record in step["ranks"].items():
            assert record["loss_calls"], f"step {step['index']} rank {rank}: no loss call"
            for call in record["loss_calls"]:
                data = call["data"]
                used = (float(data["bapo_c_low"][0]), float(data["bapo_c_high"][0]))
                assert used == pytest.approx((expected.c_low, expected.c_high), abs=1e-9), (step["index"], rank)
                # the metric NeMo-RL logs (token-weighted) says the same
                mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
                weight = float(mask.sum()) / call["global_valid_toks"]
                if weight > 0:
                    assert call["metrics"]["bapo/c_high"] / weight == pytest.approx(expected.c_high, abs=1e-9)
    print(f"largest |searched - one-process| log-prob over trained tokens: {worst:.2e}")
    assert worst <= LOGPROB_TOLERANCE, f"the driver searched with log-probs {worst:.2e} off the weights before the step"
    # Some steps searched away from the starting bounds: the comparison weighed real ratios.
    assert moved >= 1 or not some_step_moves, "every step stayed at the starting bounds: the rehearsal's ratios never moved"
