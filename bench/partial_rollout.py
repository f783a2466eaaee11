"""Generated tokens/s with and without partial rollouts, side by side in one run, on CPU.

Same tiny Qwen2, same prompts, same number of prompt groups per training step. Response lengths follow
the bundled task's heavy-tailed mix: each response stops (as at EOS) after the length of its task's
reference solution, so both modes generate exactly the same length distribution whatever the weights.

  without: every step generates its groups to completion; the step waits for its longest response
           (finished rows leave the batch, so the tail runs at a tiny batch size).
  with:    each iteration grows every in-flight response by at most `token_budget` tokens; unfinished
           ones carry over and run alongside new prompts, so the batch stays full.

    python bench/partial_rollout.py [--steps 12] [--token-budget 16]
Writes bench/results/partial_rollout.json and .png.

On a GPU, with a model where decode costs what it costs on real ones (wall time; the ratio uses it):
    python bench/partial_rollout.py --device cuda --layers 12 --hidden 1024 --precision bfloat16
writes bench/results/partial_rollout_cuda.json and .png.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bapo_nemo.embedded.data.tasks import TaskGenerator
from bapo_nemo.embedded.loop.evaluation import encode_prompt
from bapo_nemo.embedded.loop.generation import sample_continuations
from bapo_nemo.embedded.model.policy import build_model, prepare_model
from bapo_nemo.embedded.model.tokenizer import load_tokenizer
from bapo_nemo.rollout import GenerationChunk, PartialRolloutConfig, PartialRolloutManager, PromptItem

RESULTS = Path(__file__).parent / "results"


def run_mode(name, model, tokenizer, args, budget, in_flight, compact=True):
    """Generated tokens and wall time over `args.steps` training steps (after `args.warmup_steps` steps
    that fill the pipeline and are not timed)."""
    config = PartialRolloutConfig(
        token_budget=budget,
        max_resumptions=64,
        max_response_tokens=args.max_len,
        max_in_flight_groups=in_flight,
    )
    manager = PartialRolloutManager(config, args.group_size)
    tasks = TaskGenerator(args.seed, 1, args.max_ops, args.tail_alpha)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    eos = tokenizer.eos_token_id
    question_end = tokenizer.convert_tokens_to_ids("?")
    target_of: dict[tuple[int, ...], int] = {}  # prompt -> response length of its reference solution

    def generate_fn(contexts, max_new_tokens):
        # A prompt ends at its first '?': what follows is the response so far. Stop at the target length.
        prompt_lens = [c.index(question_end) + 1 for c in contexts]
        targets = [target_of[tuple(c[:p])] for c, p in zip(contexts, prompt_lens)]
        done = [len(c) - p for c, p in zip(contexts, prompt_lens)]
        limits = [max(0, min(max_new_tokens, t - d)) for t, d in zip(targets, done)]
        outs = sample_continuations(
            model, contexts, limits, eos, tokenizer.pad_token_id, generator, compact=compact
        )
        chunks = []
        for o, t, d in zip(outs, targets, done):
            # An early EOS of the untrained model is replaced, so lengths follow the task mix exactly.
            ids = [i if i != eos else tokenizer.convert_tokens_to_ids(";") for i in o.token_ids]
            chunks.append(GenerationChunk(ids, o.logprobs, d + len(ids) >= t))
        return chunks

    tokens, elapsed, cpu, per_step = 0, 0.0, 0.0, []
    for step in range(args.warmup_steps + args.steps):
        synchronize(args.device)
        t0, c0, step_tokens, groups = time.perf_counter(), time.process_time(), 0, []
        while len(groups) < args.prompts_per_step:
            queued = manager.num_pending + manager.num_in_flight + manager.num_completed
            items = []
            for task in tasks.sample(max(0, in_flight - queued)):
                ids = encode_prompt(tokenizer, task.question)
                target_of[tuple(ids)] = min(len(task.solution) + 1, args.max_len)
                items.append(PromptItem(task.prompt_id, ids, {}))
            manager.add_prompts(items)
            groups += manager.run_iteration(generate_fn, step, args.prompts_per_step - len(groups))
            step_tokens += manager.stats(step)["rollout/tokens_last_iteration"]
        synchronize(args.device)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if step >= args.warmup_steps:
            tokens += step_tokens
            elapsed += dt
            cpu += dc
            per_step.append(step_tokens / (dt if wall_clock(args) else dc))
        print(f"  {name:>8} step {step:2d}: {step_tokens:6.0f} tokens in {dt:5.2f}s wall, {dc:5.2f}s CPU")
    # On a shared machine wall time depends on the neighbours; this process is single-threaded, so its
    # CPU time is the wall time it would take alone. Both are reported; on CPU the ratio uses CPU time,
    # on a GPU wall time (the host mostly waits for the device there).
    return {
        "tokens": tokens,
        "wall_seconds": elapsed,
        "cpu_seconds": cpu,
        "tokens_per_s": tokens / cpu,
        "wall_tokens_per_s": tokens / elapsed,
        "per_step_tokens_per_s": per_step,
    }


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_clock(args) -> bool:
    """Rates by wall time on a GPU (the host mostly waits there), by this process's CPU time on a CPU."""
    return args.device == "cuda"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=32)
    parser.add_argument(
        "--in-flight-factor",
        type=float,
        default=1.5,
        help="with partial rollouts: groups in flight = factor x prompts per step",
    )
    parser.add_argument("--max-ops", type=int, default=12)
    parser.add_argument("--tail-alpha", type=float, default=1.5)
    parser.add_argument("--max-len", type=int, default=112)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (MLP 3x, 64-wide heads)")
    parser.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                        help="bfloat16: bf16 autocast, as the embedded trainer runs on a GPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    model_cfg = SimpleNamespace(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=max(4, args.hidden // 64),
        num_kv_heads=max(2, args.hidden // 256),
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    model = build_model(model_cfg, tokenizer, seed=0)
    model = prepare_model(model, torch.device(args.device), "float32", args.precision, False).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.layers} layers, hidden {args.hidden}, {params / 1e6:.1f}M parameters on {args.device}"
          f" ({args.precision})")

    print("without partial rollouts, static batch (finished rows wait for the longest, as HF generate):")
    static = run_mode(
        "static", model, tokenizer, args, budget=args.max_len, in_flight=args.prompts_per_step, compact=False
    )
    print("without partial rollouts (each step generates its groups to completion, finished rows leave):")
    without = run_mode(
        "without", model, tokenizer, args, budget=args.max_len, in_flight=args.prompts_per_step
    )
    in_flight = int(args.in_flight_factor * args.prompts_per_step)
    print(f"with partial rollouts (token_budget={args.token_budget}, {in_flight} groups in flight):")
    with_ = run_mode("with", model, tokenizer, args, budget=args.token_budget, in_flight=in_flight)
    rate, unit = ("wall_tokens_per_s", "second") if wall_clock(args) else ("tokens_per_s", "CPU-second")
    ratio = with_[rate] / without[rate]
    ratio_static = with_[rate] / static[rate]
    wall_ratio = with_["wall_tokens_per_s"] / without["wall_tokens_per_s"]
    print(
        f"\ngenerated tokens per {unit}  without: {without[rate]:.0f}  with: {with_[rate]:.0f}"
        f"  ratio with/without: {ratio:.2f}x   (wall-clock ratio on this machine: {wall_ratio:.2f}x)"
    )
    print(f"static batch without partial rollouts: {static[rate]:.0f}   ratio with/static: {ratio_static:.2f}x")

    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "args": vars(args),
        "without": without,
        "with": with_,
        "ratio": ratio,
        "wall_ratio": wall_ratio,
        "static_batch": static,
        "ratio_vs_static_batch": ratio_static,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "parameters": params,
        "rate": rate,
    }
    stem = "partial_rollout_cuda" if args.device == "cuda" else "partial_rollout"
    (RESULTS / f"{stem}.json").write_text(json.dumps(record, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(
        ["static batch", "without", f"with (budget {args.token_budget})"],
        [static[rate], without[rate], with_[rate]],
        color=["tab:red", "tab:gray", "tab:blue"],
    )
    ax1.set_ylabel(f"generated tokens / {unit}")
    ax1.set_title(f"partial rollouts: {ratio:.2f}x ({record['device']}, {params / 1e6:.0f}M parameters)")
    ax2.plot(static["per_step_tokens_per_s"], "o-", color="tab:red", label="static batch")
    ax2.plot(without["per_step_tokens_per_s"], "o-", color="tab:gray", label="without")
    ax2.plot(with_["per_step_tokens_per_s"], "o-", color="tab:blue", label="with")
    ax2.set_xlabel("timed step")
    ax2.set_ylabel(f"tokens / {unit}")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)
    print(f"wrote {RESULTS / stem}.json and .png")


if __name__ == "__main__":
    main()
