"""End-to-end RL tokens/s of the embedded trainer vs TRL's GRPOTrainer, side by side in one run, on CPU.

Same Qwen2 built from config (same config and initial weights), same tokenizer, same prompts (the bundled
arithmetic tasks), same batch (prompts x group size), same maximum completion length, temperature 1, one
optimizer update per rollout batch, no KL term, AdamW at a constant learning rate. Both start from the
untrained model, so response lengths come from the same sampling distribution. Throughput = generated
completion tokens / time spent in RL steps (generation + loss + optimizer), first step of each excluded
(start-up), evaluation and checkpoints excluded. Time is process CPU time (both run single-threaded in
this process, so it equals the wall time on an otherwise idle machine; wall time on a shared machine is
reported too, with the load average around each run). Ours is measured with partial rollouts off and on.
Every setting the comparison depends on is pinned here (PINNED), not read from configs/local_cpu.yaml.
`--repeats N` (odd) runs the trainers N times, interleaved, and keeps each one's median.

Two model sizes, both built from config with the same initial weights for both trainers: `tiny` (the
default run's 2-layer, hidden-128 Qwen2, ~0.4M parameters) and `medium` (8 layers, hidden 512, ~25M).

    pip install -e '.[bench]'   # trl
    python bench/vs_trl.py [--steps 12] [--repeats 3]                          # tiny: bench/results/vs_trl.json, .png
    python bench/vs_trl.py --size medium --steps 4 --prompts 8 --skip-microbatch  # vs_trl_medium.json, .png
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bapo_nemo.embedded.config.run_config import load_config
from bapo_nemo.embedded.data.tasks import TaskGenerator, extract_answer
from bapo_nemo.embedded.model.policy import build_model
from bapo_nemo.embedded.model.tokenizer import load_tokenizer
from bapo_nemo.embedded.run.trainer import train

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]
# Every setting the comparison depends on, pinned over configs/local_cpu.yaml (whose RL regime may change):
# model and tasks (both trainers), sampling, loss, optimizer and step shape (ours; TRL's mirror in run_trl).
PINNED = [
    "grpo.seed=0",
    "runtime.device=cpu",
    "policy.precision=float32",
    "runtime.progress=false",
    "policy.model_name=null",
    "model.dtype=float32",
    "model.max_position_embeddings=256",
    "model.rope_theta=10000.0",
    "task.train_file=null",
    "task.eval_file=null",
    "task.min_ops=1",
    "task.max_ops=6",
    "task.tail_alpha=1.5",
    "task.max_value=99",
    "task.max_operand=9",
    "task.eval_size=4",
    "data.train.data_path=null",
    "warmup.steps=0",
    "policy.generation.temperature=1.0",
    "partial_rollouts.max_resumptions=4",
    "partial_rollouts.global_token_budget=null",
    "partial_rollouts.prompts_per_iteration=null",
    "partial_rollouts.stale_segments=keep",
    "replay.groups_per_step=0",
    "loss_fn.bapo.ratio_reference=behavior",
    "loss.entropy_coef=0.0",
    "loss_fn.bapo.enabled=true",
    "loss_fn.bapo.rho0=0.4",
    "loss_fn.bapo.order=paper",
    "loss_fn.bapo.measure=gradient",
    "policy.optimizer.kwargs.weight_decay=0.0",
    "policy.optimizer.kwargs.betas=[0.9,0.99]",
    "policy.max_grad_norm=1.0",
    "train.updates_per_batch=1",
    "policy.train_micro_batch_size=32",
    "train.step_search_graph_tokens=65536",
    "policy.dtensor_cfg.activation_checkpointing=false",
    "eval.k=1",
]
# model shape per size, built from config (the same weights for both trainers)
SIZES = {
    "tiny": [
        "model.hidden_size=128",
        "model.intermediate_size=384",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
    ],
    "medium": [
        "model.hidden_size=512",
        "model.intermediate_size=1536",
        "model.num_layers=8",
        "model.num_heads=8",
        "model.num_kv_heads=4",
    ],
}


def bench_config(args, extra: list[str] = ()):
    return load_config(REPO / "configs" / "local_cpu.yaml", [*PINNED, *SIZES[args.size], *extra])


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
    cfg = bench_config(
        args,
        [
            f"grpo.max_num_steps={args.steps + 1}",
            f"grpo.num_prompts_per_step={args.prompts}",
            f"grpo.num_generations_per_prompt={args.group_size}",
            f"partial_rollouts.max_response_tokens={args.max_len}",
            f"partial_rollouts.token_budget={args.token_budget if partial else args.max_len}",
            f"partial_rollouts.max_in_flight_groups={2 * args.prompts if partial else args.prompts}",
            f"grpo.val_period={10 * args.steps}",
            f"checkpointing.save_period={10 * args.steps}",
            f"loss_fn.bapo.granularity={granularity}",
            f"policy.optimizer.kwargs.lr={args.lr}",
            f"runtime.num_threads={args.threads}",
        ],
    )
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
    cfg = bench_config(args)
    model = build_model(cfg.model, tokenizer, seed=cfg.grpo.seed)
    args.parameters = sum(p.numel() for p in model.parameters())
    tasks = TaskGenerator(cfg.grpo.seed, cfg.task.min_ops, cfg.task.max_ops, cfg.task.tail_alpha).sample(
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
            seed=cfg.grpo.seed,
            bf16=False,
            fp16=False,
            # ours' optimizer settings (PINNED): AdamW, constant lr, grad-norm clip 1
            adam_beta1=0.9,
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
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
    parser.add_argument("--repeats", type=int, default=1, help="runs of each trainer, interleaved (median kept)")
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="model size (built from config)"
    )
    parser.add_argument(
        "--skip-microbatch", action="store_true", help="leave out the per-micro-batch search variant"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    variants = {
        "trl_grpo": ("TRL GRPOTrainer", lambda: run_trl(args)),
        "ours_no_partial": ("embedded trainer, partial rollouts off", lambda: run_ours(args, partial=False)),
        "ours_partial": ("embedded trainer, partial rollouts on", lambda: run_ours(args, partial=True)),
    }
    if not args.skip_microbatch:
        variants["ours_no_partial_microbatch"] = (
            "embedded trainer, partial rollouts off, one bound search per micro-batch (no extra forward)",
            lambda: run_ours(args, partial=False, granularity="microbatch"),
        )
    # Repeats interleave the trainers, so a change in the machine's load hits all of them alike; each
    # trainer's figure is its median repeat (by CPU time: the same seeds give the same tokens every time).
    repeats: dict[str, list[dict]] = {name: [] for name in variants}
    for rep in range(args.repeats):
        for name, (label, run) in variants.items():
            print(f"[{rep + 1}/{args.repeats}] {label} ...")
            load_before = os.getloadavg()[0]
            torch.set_num_threads(args.threads)
            result = run()
            result["load_average_1min"] = [load_before, os.getloadavg()[0]]
            repeats[name].append(result)
    rows = {
        name: sorted(runs, key=lambda r: r["cpu_seconds"])[(len(runs) - 1) // 2] for name, runs in repeats.items()
    }
    trl, ours_full, ours = rows["trl_grpo"], rows["ours_no_partial"], rows["ours_partial"]
    for name, r in rows.items():
        each = ", ".join(f"{x['tokens_per_s']:.0f}" for x in repeats[name])
        print(
            f"  {name:16s} {r['tokens_per_s']:8.0f} tokens per CPU-second ({r['tokens']:.0f} tokens, "
            f"{r['cpu_seconds']:.1f}s CPU, {r['wall_seconds']:.1f}s wall; mean completion "
            f"{r['mean_completion_length']:.1f}; load {r['load_average_1min'][0]:.1f}-"
            f"{r['load_average_1min'][1]:.1f})"
            + (f"; repeats {each}" if args.repeats > 1 else "")
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
        "repeats": repeats,
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
