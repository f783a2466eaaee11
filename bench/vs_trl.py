"""End-to-end RL tokens/s of the embedded trainer vs TRL's GRPOTrainer, side by side in one run, on CPU.

Same tiny Qwen2 (same config and initial weights), same tokenizer, same prompts (the bundled arithmetic
tasks), same batch (prompts x group size), same maximum completion length, temperature 1, one optimizer
update per rollout batch, no KL term. Both start from the untrained model, so response lengths come from
the same sampling distribution. Throughput = generated completion tokens / time spent in RL steps
(generation + loss + optimizer), first step of each excluded (start-up), evaluation and checkpoints
excluded. Time is process CPU time (both run single-threaded in this process, so it equals the wall time
on an otherwise idle machine; wall time on a shared machine is reported too). Ours is measured twice: with partial rollouts (its default) and with them off.

Two model sizes, both built from config with the same initial weights for both trainers: `tiny` (the
default run's 2-layer, hidden-128 Qwen2, ~0.4M parameters) and `medium` (8 layers, hidden 512, ~25M).

    pip install -e '.[bench]'   # trl
    python bench/vs_trl.py [--steps 12]                        # tiny: bench/results/vs_trl.json and .png
    python bench/vs_trl.py --size medium --steps 4 --prompts 8   # bench/results/vs_trl_medium.json and .png
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bapo_nemo.embedded.config import load_config
from bapo_nemo.embedded.model import build_model
from bapo_nemo.embedded.tasks import TaskGenerator, extract_answer
from bapo_nemo.embedded.tokenizer import load_tokenizer
from bapo_nemo.embedded.trainer import train

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
# model overrides of configs/local_cpu.yaml per size (tiny: the file's own model)
SIZES = {
    "tiny": [],
    "medium": [
        "model.hidden_size=512",
        "model.intermediate_size=1536",
        "model.num_layers=8",
        "model.num_heads=8",
        "model.num_kv_heads=4",
    ],
}


def throughput(tokens: float, wall_seconds: float, cpu_seconds: float, lengths: list[float]) -> dict:
    """One trainer's figures, the same fields for ours and TRL's (one entry of `lengths` per timed step)."""
    return {
        "tokens": tokens,
        "wall_seconds": wall_seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_s": tokens / cpu_seconds,
        "wall_tokens_per_s": tokens / wall_seconds,
        "mean_completion_length": sum(lengths) / len(lengths),
        "steps": len(lengths),
    }


def run_ours(args, partial: bool, granularity: str = "step") -> dict:
    overrides = [
        "warmup.steps=0",
        f"train.max_steps={args.steps + 1}",
        "train.updates_per_batch=1",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.partial.max_response_tokens={args.max_len}",
        f"rollout.partial.token_budget={args.token_budget if partial else args.max_len}",
        f"rollout.partial.max_in_flight_groups={2 * args.prompts if partial else args.prompts}",
        f"eval.every={10 * args.steps}",
        "eval.k=1",
        "task.eval_size=4",
        "runtime.progress=false",
        f"checkpoint.every={10 * args.steps}",
        f"loss.bapo.granularity={granularity}",
        f"optim.lr={args.lr}",
        f"runtime.num_threads={args.threads}",
        *SIZES[args.size],
    ]
    cfg = load_config(REPO / "configs" / "local_cpu.yaml", overrides)
    with tempfile.TemporaryDirectory() as out:
        train(cfg, out)
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 2]  # step 1 excluded (start-up)
    tokens = sum(r["perf/generated_tokens"] for r in steps)
    seconds = sum(r["perf/step_time_s"] for r in steps)
    cpu = sum(r["perf/step_cpu_s"] for r in steps)
    lengths = [r["train/response_length_mean"] for r in steps]
    return throughput(tokens, seconds, cpu, lengths)


def run_trl(args) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = load_tokenizer()
    cfg = load_config(REPO / "configs" / "local_cpu.yaml", SIZES[args.size])
    model = build_model(cfg.model, tokenizer, seed=cfg.seed)
    args.parameters = sum(p.numel() for p in model.parameters())
    tasks = TaskGenerator(cfg.seed, cfg.task.min_ops, cfg.task.max_ops, cfg.task.tail_alpha).sample(
        args.prompts * (args.steps + 1)
    )
    dataset = Dataset.from_list(
        [{"prompt": tokenizer.bos_token + t.question, "answer": t.answer} for t in tasks]
    )

    def correct(completions, answer, **_):
        return [1.0 if extract_answer(c) == a else 0.0 for c, a in zip(completions, answer)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.cpu, self.logs, self._t, self._c = [], [], [], 0.0, 0.0

        def on_step_begin(self, *_, **__):
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self._t)
            self.cpu.append(time.process_time() - self._c)

        def on_log(self, _args, _state, _control, logs=None, **__):
            self.logs.append(dict(logs or {}))

    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            max_steps=args.steps + 1,
            learning_rate=args.lr,
            per_device_train_batch_size=args.prompts * args.group_size,
            num_generations=args.group_size,
            steps_per_generation=1,
            num_iterations=1,
            max_completion_length=args.max_len,
            temperature=1.0,
            beta=0.0,
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=cfg.seed,
            bf16=False,
            fp16=False,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=correct,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        trainer.train()
    step_logs = [log for log in clock.logs if "completions/mean_length" in log]
    lengths = [log["completions/mean_length"] for log in step_logs][1:]
    seconds, cpu = sum(clock.times[1:]), sum(clock.cpu[1:])
    tokens = sum(length * args.prompts * args.group_size for length in lengths)
    return throughput(tokens, seconds, cpu, lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed RL steps per trainer (plus one untimed)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="model size (built from config)"
    )
    parser.add_argument(
        "--skip-microbatch", action="store_true", help="leave out the per-micro-batch search variant"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print("TRL GRPOTrainer ...")
    trl = run_trl(args)
    torch.set_num_threads(args.threads)
    print("embedded trainer, partial rollouts off ...")
    ours_full = run_ours(args, partial=False)
    print("embedded trainer, partial rollouts on ...")
    ours = run_ours(args, partial=True)
    rows = {"trl_grpo": trl, "ours_no_partial": ours_full, "ours_partial": ours}
    if not args.skip_microbatch:
        print(
            "embedded trainer, partial rollouts off, one bound search per micro-batch (no extra forward) ..."
        )
        rows["ours_no_partial_microbatch"] = run_ours(args, partial=False, granularity="microbatch")
    for name, r in rows.items():
        print(
            f"  {name:16s} {r['tokens_per_s']:8.0f} tokens per CPU-second ({r['tokens']:.0f} tokens, "
            f"{r['cpu_seconds']:.1f}s CPU, {r['wall_seconds']:.1f}s wall; mean completion "
            f"{r['mean_completion_length']:.1f})"
        )
    ratio = ours["tokens_per_s"] / trl["tokens_per_s"]
    ratio_full = ours_full["tokens_per_s"] / trl["tokens_per_s"]
    print(
        f"\n{args.size} model ({args.parameters / 1e6:.1f}M parameters), ours / TRL: {ratio:.2f}x with partial "
        f"rollouts, {ratio_full:.2f}x without"
        + (
            f", {rows['ours_no_partial_microbatch']['tokens_per_s'] / trl['tokens_per_s']:.2f}x without and "
            "with micro-batch bound search"
            if "ours_no_partial_microbatch" in rows
            else ""
        )
    )
    stem = "vs_trl" if args.size == "tiny" else f"vs_trl_{args.size}"

    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "args": vars(args),
        **rows,
        "ratio_partial_vs_trl": ratio,
        "ratio_no_partial_vs_trl": ratio_full,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(record, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {
        "trl_grpo": "TRL\nGRPOTrainer",
        "ours_no_partial": "ours\n(no partial)",
        "ours_partial": "ours\n(partial)",
        "ours_no_partial_microbatch": "ours (no partial,\nmicro-batch search)",
    }
    ax.bar(
        [labels[k] for k in rows],
        [r["tokens_per_s"] for r in rows.values()],
        color=["tab:gray", "tab:cyan", "tab:blue", "tab:green"][: len(rows)],
    )
    ax.set_ylabel("generated tokens / CPU-second (RL steps)")
    ax.set_title(
        f"end-to-end RL on CPU, {args.size} model ({args.parameters / 1e6:.1f}M): ours {ratio:.2f}x TRL"
    )
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)
    print(f"wrote {RESULTS / (stem + '.json')} and .png")


if __name__ == "__main__":
    main()
