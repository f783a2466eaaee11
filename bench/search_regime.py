"""BAPO's bound search with few responses per search: the cluster regime, reproduced on the embedded trainer.

On the shipped NeMo-RL configs a `granularity: microbatch` search sees one packed bin per data-parallel
rank: ~2-5 long responses (`bapo-nemo check` reports it). This script puts the embedded trainer in that
regime and measures, on the same weights and the same mini-batch, what every granularity would choose:

- the embedded trainer's real pieces: warm-up (SFT), sampling, rewards, GRPO advantages, and 4 optimizer
  updates per rollout batch (`policy_update`, step granularity, which drives the policy);
- before each update, the current log-probs of the mini-batch (no-grad forward), then
  * `step`: one search over the whole mini-batch (what `granularity: step` uses);
  * `microbatch` with m responses per search (m = 1 .. 32), the responses grouped by similar length as
    packing groups them. On D data-parallel ranks a search sums D micro-batches' statistics (one
    all-reduce), which tests/unit/test_algorithm_distributed.py proves equals one search on their union:
    m responses per search = D ranks x m / D responses per packed bin (adjacent bins, similar lengths);
- `step` with `loss_fn.bapo.step_bounds_sample` (docs/nemo_rl.md, "Cheaper step-wide bounds"), on the
  later updates of each rollout batch (the first is exact in every scheme): the search over a random
  sample of the mini-batch's prompt groups (f = 0.5, 0.25; `SAMPLE_DRAWS` draws per update), and over
  all rows at the log-probs of the weights at the start of the rollout batch (f = 0);
- per search: target met (else the bounds are the saturated end of the path), one advantage sign only,
  the chosen bounds, and their distance to the step search's bounds on the same update.

Writes bench/results/search_regime.json and docs/results/search_regime.png; prints the table.
Usage: python bench/search_regime.py [--seeds 2] [--batches 8] [--warmup-steps 500]  (~2 min per seed, 1 thread)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bapo_nemo.algorithm import search_clip_bounds
from bapo_nemo.algorithm.bapo import importance_ratio
from bapo_nemo.embedded.config.run_config import load_config
from bapo_nemo.embedded.data.tasks import Task, TaskStream, reward
from bapo_nemo.embedded.loop import warmup as warmup_io
from bapo_nemo.embedded.loop.evaluation import decode_response, encode_prompt
from bapo_nemo.embedded.loop.generation import sample_continuations
from bapo_nemo.embedded.loop.grpo import (
    build_batch,
    forward_logprobs,
    length_sorted_micro_batches,
    policy_update,
)
from bapo_nemo.embedded.model.policy import build_model
from bapo_nemo.embedded.model.tokenizer import load_tokenizer
from bapo_nemo.rollout import GenerationChunk, PartialRolloutManager, PromptItem, split_minibatches

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLOT = ROOT / "docs" / "results" / "search_regime.png"
MICRO_SIZES = (1, 2, 4, 8, 16, 32)
SAMPLE_FRACTIONS = (0.5, 0.25)  # step_bounds_sample values that run the extra pass on a sample
SAMPLE_DRAWS = 4  # random group samples per later update and fraction
# Fixed before measuring (docs/nemo_rl.md, "Cheaper step-wide bounds"): a step_bounds_sample value may be
# shipped only if its mean bound distance to the exact step search and its target-met share (against
# the exact search on the same later updates) are both within this.
TOLERANCE = 0.05
UPDATES = 4  # optimizer updates per rollout batch, as the cluster configs (1,024 responses / 256)


def run_config(warmup_steps: int, seed: int, lr: float | None = None):
    """configs/local_cpu.yaml, with whole responses (no partial rollouts: the cluster configs have none)
    and the cluster's 4 updates per rollout batch; 32 prompts x 8 samples -> mini-batches of 64."""
    return load_config(
        ROOT / "configs" / "local_cpu.yaml",
        [
            f"grpo.seed={seed}",
            f"warmup.steps={warmup_steps}",
            "grpo.num_prompts_per_step=32",
            "partial_rollouts.token_budget=80",
            "partial_rollouts.max_in_flight_groups=32",
            f"train.updates_per_batch={UPDATES}",
            "loss_fn.bapo.granularity=step",
            *([f"policy.optimizer.kwargs.lr={lr}"] if lr is not None else []),
        ],
    )


def run_seed(seed: int, batches: int, warmup_steps: int, lr: float | None = None) -> list[dict]:
    cfg = run_config(warmup_steps, seed, lr)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer()
    model = build_model(cfg.model, tokenizer, seed)
    warm = TaskStream(seed + 7919, cfg.task, set(), None, cfg.warmup.step_error_rate)
    warmup_io.run_warmup(model, tokenizer, warm, cfg.warmup, torch.device("cpu"), progress=False)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.policy.optimizer.kwargs.lr, betas=cfg.policy.optimizer.kwargs.betas
    )
    stream = TaskStream(seed, cfg.task, set(), None)
    manager = PartialRolloutManager(cfg.partial_rollouts, cfg.grpo.num_generations_per_prompt)
    sample_gen = torch.Generator().manual_seed(seed + 1)
    shuffle_gen = torch.Generator().manual_seed(seed + 2)
    group_gen = torch.Generator().manual_seed(seed + 3)  # step_bounds_sample's group draws
    bapo = cfg.loss_fn.bapo

    def generate_fn(contexts, max_new_tokens):
        outs = sample_continuations(
            model, contexts, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id, sample_gen
        )
        return [GenerationChunk(o.token_ids, o.logprobs, o.finished) for o in outs]

    def score(r) -> float:  # a response cut off without EOS scores 0, as in the trainer
        if r.truncated:
            return 0.0
        return reward(
            decode_response(tokenizer, r.response_token_ids),
            Task(r.prompt_id, r.meta["question"], r.meta["answer"]),
        )

    records, version = [], 0
    for b in range(batches):
        manager.add_prompts(
            [
                PromptItem(
                    t.prompt_id,
                    encode_prompt(tokenizer, t.question),
                    {"question": t.question, "answer": t.answer},
                )
                for t in stream.next(cfg.grpo.num_prompts_per_step)
            ]
        )
        groups = []
        while len(groups) < cfg.grpo.num_prompts_per_step:
            groups += manager.run_iteration(generate_fn, version, cfg.grpo.num_prompts_per_step - len(groups))
        rewards = [[score(r) for r in g.rollouts] for g in groups]
        batch = build_batch(groups, rewards, tokenizer.pad_token_id)
        minibatches = split_minibatches(len(batch), UPDATES, cfg.grpo.num_generations_per_prompt, shuffle_gen)
        with torch.no_grad():  # step_bounds_sample=0: the log-probs of the rollout batch's start weights
            start_logprobs = [forward_logprobs(model, batch.select(rows), 64) for rows in minibatches]
        for u, rows in enumerate(minibatches):
            mb = batch.select(rows)
            width = mb.mask.shape[1]
            old, weights = batch.behavior_logprobs[rows][:, :width], batch.loss_weights[rows][:, :width]
            ratio = importance_ratio(forward_logprobs(model, mb, 64), old)
            adv = mb.advantages.expand_as(ratio)

            def search(idx, ratio=ratio, adv=adv, mask=mb.mask, weights=weights):
                i = torch.tensor(idx)
                return search_clip_bounds(ratio[i], adv[i], mask[i], bapo, weights=weights[i])

            step = search(list(range(len(mb))))
            modes = {("step", len(mb)): [(list(range(len(mb))), step)]}
            for m in MICRO_SIZES:
                modes[(f"microbatch m={m}", m)] = [
                    (idx, search(idx)) for idx in length_sorted_micro_batches(mb, m)
                ]
            if u > 0:  # later updates: where step_bounds_sample differs from the exact search
                everything = list(range(len(mb)))
                modes[("step, later updates", len(mb))] = [(everything, step)]
                groups = sorted({int(g) for g in mb.group_index})
                for f in SAMPLE_FRACTIONS:
                    k = max(1, round(f * len(groups)))
                    draws = []
                    for _ in range(SAMPLE_DRAWS):
                        pick = torch.randperm(len(groups), generator=group_gen)[:k].tolist()
                        chosen = {groups[j] for j in pick}
                        idx = [i for i in everything if int(mb.group_index[i]) in chosen]
                        draws.append((idx, search(idx)))
                    modes[(f"step sample={f:g}", len(draws[0][0]))] = draws
                start_ratio = importance_ratio(start_logprobs[u][:, :width], old)
                modes[("step sample=0 (start weights)", len(mb))] = [
                    (everything, search(everything, ratio=start_ratio))
                ]
            for (mode, n), results in modes.items():
                for idx, res in results:
                    records.append(
                        {
                            "seed": seed,
                            "batch": b,
                            "update": u,
                            "mode": mode,
                            "responses": n,
                            "groups": len({int(mb.group_index[i]) for i in idx}),
                            "rho_initial": res.rho_initial,
                            "c_low": res.c_low,
                            "c_high": res.c_high,
                            "target_met": bool(res.target_met),
                            "one_sided": res.tokens_pos == 0 or res.tokens_neg == 0,
                            "tokens": res.num_tokens,
                            "dist_to_step": abs(res.c_low - step.c_low) + abs(res.c_high - step.c_high),
                        }
                    )
            policy_update(
                model,
                optimizer,
                mb,
                old,
                weights,
                cfg.loss_fn.bapo,
                cfg.policy.train_micro_batch_size,
                cfg.policy.max_grad_norm,
                cfg.train.step_search_graph_tokens,
                cfg.loss.entropy_coef,
            )
            version += 1
    return records


def summarize(records: list[dict]) -> dict[str, dict]:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        rs = [r for r in records if r["mode"] == mode and r["tokens"] > 0]
        out[mode] = {
            "responses": rs[0]["responses"],
            "searches": len(rs),
            "groups_mean": statistics.mean(r["groups"] for r in rs),
            "target_met": statistics.mean(r["target_met"] for r in rs),
            "one_sided": statistics.mean(r["one_sided"] for r in rs),
            "rho_initial_std": statistics.pstdev(r["rho_initial"] for r in rs),
            "c_high_mean": statistics.mean(r["c_high"] for r in rs),
            "c_high_std": statistics.pstdev(r["c_high"] for r in rs),
            "c_low_mean": statistics.mean(r["c_low"] for r in rs),
            "c_low_std": statistics.pstdev(r["c_low"] for r in rs),
            "dist_to_step_mean": statistics.mean(r["dist_to_step"] for r in rs),
        }
    return out


def plot(records: list[dict], summary: dict, path: Path, lr: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    step = summary["step"]
    names = [f"microbatch m={m}" for m in MICRO_SIZES]
    xs = [summary[n]["responses"] for n in names]
    axes[0].plot(xs, [summary[n]["target_met"] for n in names], marker="o", label="microbatch")
    axes[1].plot(xs, [summary[n]["one_sided"] for n in names], marker="o", label="microbatch")
    axes[2].plot(xs, [summary[n]["dist_to_step_mean"] for n in names], marker="o", label="microbatch")
    axes[0].axhline(step["target_met"], color="k", ls="--", label=f"step ({step['responses']} responses)")
    axes[1].axhline(step["one_sided"], color="k", ls="--", label="step")
    sampled = [n for n in summary if n.startswith("step sample=") and "start" not in n]
    if sampled:  # step_bounds_sample on the later updates
        xs = [summary[n]["responses"] for n in sampled]
        for ax, key in zip(axes, ("target_met", "one_sided", "dist_to_step_mean")):
            ax.plot(xs, [summary[n][key] for n in sampled], marker="s", ls="", color="C2",
                    label="step, sampled groups (later updates)")
        start = summary["step sample=0 (start weights)"]
        for ax, key in ((axes[0], "target_met"), (axes[2], "dist_to_step_mean")):
            ax.axhline(start[key], color="C3", ls=":", label="step, start-of-batch log-probs")
        axes[2].axhline(TOLERANCE, color="C2", ls="--", lw=0.8, label=f"tolerance {TOLERANCE}")
    for ax, title in zip(
        axes,
        (
            "searches that meet rho0 (the rest saturate)",
            "searches that see one advantage sign only",
            "|c_low - c_low(step)| + |c_high - c_high(step)|, mean",
        ),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("responses per search")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[:2]:
        ax.set_ylim(-0.02, 1.02)
    fig.suptitle(
        "BAPO bound search vs responses per search (embedded trainer, 4 updates per rollout batch"
        + (f", lr {lr:g})" if lr is not None else ")")
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--batches", type=int, default=8, help="rollout batches per seed")
    parser.add_argument("--warmup-steps", type=int, default=500)
    parser.add_argument("--lr", type=float, default=None, help="RL learning rate (default: local_cpu.yaml's)")
    parser.add_argument("--tag", default="", help="suffix of the output files, e.g. _lr1e-3")
    args = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    records = [
        r for seed in range(args.seeds) for r in run_seed(seed, args.batches, args.warmup_steps, args.lr)
    ]
    summary = summarize(records)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_json = RESULTS / f"search_regime{args.tag}.json"
    out_png = PLOT.with_name(f"search_regime{args.tag}.png")
    out_json.write_text(
        json.dumps({"args": vars(args), "summary": summary, "seconds": time.perf_counter() - t0}, indent=1)
    )
    plot(records, summary, out_png, args.lr)
    print(
        f"{'mode':28s} {'resp':>5s} {'groups':>6s} {'met':>6s} {'1-sign':>6s} {'sd rho0':>7s} {'c_high':>12s} {'c_low':>12s} {'|d step|':>8s}"
    )
    for mode, s in summary.items():
        print(
            f"{mode:28s} {s['responses']:5d} {s['groups_mean']:6.1f} {s['target_met']:6.2f} {s['one_sided']:6.2f} {s['rho_initial_std']:7.3f} "
            f"{s['c_high_mean']:5.2f} ± {s['c_high_std']:4.2f} {s['c_low_mean']:5.2f} ± {s['c_low_std']:4.2f} "
            f"{s['dist_to_step_mean']:8.3f}"
        )
    exact = summary.get("step, later updates")
    if exact is not None:
        print(f"step_bounds_sample against the exact step search on the later updates (tolerance {TOLERANCE}):")
        for mode in (m for m in summary if m.startswith("step sample=")):
            s = summary[mode]
            met_gap = abs(s["target_met"] - exact["target_met"])
            ok = s["dist_to_step_mean"] <= TOLERANCE and met_gap <= TOLERANCE
            print(
                f"  {mode:32s} distance {s['dist_to_step_mean']:.3f}, target met {s['target_met']:.2f} vs "
                f"{exact['target_met']:.2f}: {'within' if ok else 'outside'} the tolerance"
            )
    print(f"{time.perf_counter() - t0:.0f} s; wrote {out_json} and {out_png}")


if __name__ == "__main__":
    main()
