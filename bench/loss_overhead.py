"""Cost of BAPO's bound search, side by side in one run on CPU.

Compares, on the same ~1M-token batch (forward + backward where there is a loss):
  plain       the fixed-bound clipped loss ([0.8, 1.2]), nothing else
  plain+stats the same loss plus the statistics every PPO trainer logs (clip fractions by sign, mean
              ratio, approx KL): what a production plain loss costs
  bapo        search_clip_bounds (one pass, one reduction) + the loss; its statistics come from the
              search's histograms. On CPU the token pass is the fused numba loop (fused_cpu.py)
  bapo (pytorch path)  the same with the token pass in PyTorch ops, the path GPUs take
  sequential  the sequential search with the paper's settings, as the authors' code evaluates it: one
              full pass over the tokens, one reduction and one host sync per candidate (up to 52)
Prints the timings, the ratios and the number of reduction calls, and writes JSON + PNG to
bench/results/. Usage: python bench/loss_overhead.py [--tokens 1048576] [--repeats 7]

On a GPU (`--device cuda --tokens 1048576 16777216`): the same variants but the fused CPU pass, timed by
CUDA events (medians) at each size, then the search's numerics: the bounds, the positive share and the
loss with the log-probs in bfloat16 and float32 against float64. Writes loss_overhead_cuda.json + .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bapo_nemo.algorithm import (
    BAPOConfig,
    bapo_policy_loss,
    clipped_policy_loss,
    fused_cpu,
    search_clip_bounds,
)

RESULTS = Path(__file__).parent / "results"


def make_batch(n_tokens: int, seq_len: int, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    """Stale off-policy data: log-ratios ~ N(0, 0.3), advantages per sequence tilted negative (as in
    a hard batch), 10% padding: the search walks well into the c_high grid."""
    g = torch.Generator(device=device).manual_seed(seed)
    b = n_tokens // seq_len
    logp = -torch.rand(b, seq_len, generator=g, device=device, dtype=dtype) * 3
    old = logp + torch.randn(b, seq_len, generator=g, device=device, dtype=dtype) * 0.3
    adv = (torch.randn(b, 1, generator=g, device=device, dtype=dtype) - 0.3).expand(b, seq_len).contiguous()
    mask = (torch.rand(b, seq_len, generator=g, device=device) > 0.1).to(dtype)
    return logp, old, adv, mask


def plain_step(logp, old, adv, mask, with_stats: bool):
    x = logp.clone().requires_grad_(True)
    loss = clipped_policy_loss(x, old, adv, mask, mask.sum(), 0.8, 1.2)
    loss.backward()
    if with_stats:
        with torch.no_grad():
            r = torch.exp(torch.clamp(x - old, -20, 20))
            valid = mask > 0
            pos, neg = valid & (adv > 0), valid & (adv < 0)
            torch.stack([
                (pos & (r > 1.2)).sum() / pos.sum(), (neg & (r < 0.8)).sum() / neg.sum(),
                r[valid].mean(), (r - 1 - torch.log(r))[valid].mean(),
            ]).tolist()


def bapo_step(logp, old, adv, mask, config, reduce_calls):
    def all_reduce(t):  # single process: the reduction is the identity, but we count the calls
        reduce_calls.append(1)
        return t

    x = logp.clone().requires_grad_(True)
    loss, _ = bapo_policy_loss(x, old, adv, mask, mask.sum(), config, all_reduce=all_reduce)
    loss.backward()


def sequential_search(logp, old, adv, mask, config: BAPOConfig, reduce_calls):
    """Algorithm 1 evaluated candidate by candidate (value measure, paper order), as in the authors'
    loop: each evaluation is a full pass, an all-reduce of (P, N) and a `.item()` host sync."""
    r = torch.exp(torch.clamp(logp - old, -20, 20))
    lows, highs = config.c_low_grid(), config.c_high_grid()
    i = j = 0
    steps = 0

    def rho(c_low, c_high):
        eff = torch.where(adv >= 0, torch.clamp(r, max=c_high), torch.clamp(r, min=c_low)) * adv * mask
        stats = torch.stack([eff.clamp(min=0).sum(), (-eff.clamp(max=0)).sum()])
        reduce_calls.append(1)  # the all-reduce of (P, N) over the data-parallel group
        p, n = stats.tolist()
        return 1.0 if n <= 0 else p / (p + n)

    while rho(lows[j], highs[i]) < config.rho0 and j + 1 < len(lows):
        if i + 1 < len(highs):
            i += 1
        else:
            j += 1
        steps += 1
    return lows[j], highs[i], steps


def timeit(fn, repeats: int) -> float:
    """Median CPU milliseconds (process time: what the work costs, less sensitive than wall time to
    other processes on a shared machine)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def cuda_timeit(fn, repeats: int) -> float:
    """Median GPU milliseconds between CUDA events around each call (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sized_timings(n_tokens: int, seq_len: int, repeats: int, device: str) -> dict:
    """The variants on one batch, interleaved: median ms each (CUDA events on a GPU), the ratios and
    the bounds."""
    timer = cuda_timeit if device == "cuda" else timeit
    logp, old, adv, mask = make_batch(n_tokens, seq_len, device=device)
    config = BAPOConfig(measure="value")
    bounds = search_clip_bounds(torch.exp(logp - old), adv, mask, config)
    seq_bounds = sequential_search(logp, old, adv, mask, config, [])
    assert (bounds.c_low, bounds.c_high) == seq_bounds[:2], (bounds, seq_bounds)
    variants = {
        "plain": lambda: plain_step(logp, old, adv, mask, False),
        "plain+stats": lambda: plain_step(logp, old, adv, mask, True),
        "bapo (pytorch path)": lambda: bapo_step(logp, old, adv, mask, config, []),
        "bapo search only": lambda: search_clip_bounds(torch.exp(logp - old), adv, mask, config),
        "sequential search": lambda: sequential_search(logp, old, adv, mask, config, []),
    }
    rows = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            rows[name].append(timer(fn, 1))
    ms = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {
        "bapo / plain": ms["bapo (pytorch path)"] / ms["plain"],
        "bapo / plain+stats": ms["bapo (pytorch path)"] / ms["plain+stats"],
        "sequential search / bapo search": ms["sequential search"] / ms["bapo search only"],
    }
    return {"tokens": logp.numel(), "ms": ms, "ratios": ratios, "search_steps": bounds.steps,
            "sequential_steps": seq_bounds[2], "bounds": [bounds.c_low, bounds.c_high]}


def numerics(n_tokens: int, seq_len: int, device: str) -> dict:
    """The search and the loss with the log-probs in bf16 and fp32 against the same batch in fp64."""
    config = BAPOConfig()
    out = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        logp, old, adv, mask = (t.to(dtype) for t in make_batch(n_tokens, seq_len, device=device,
                                                                 dtype=torch.float64))
        x = logp.clone().requires_grad_(True)
        loss, _ = bapo_policy_loss(x, old, adv, mask, mask.sum(), config)
        loss.backward()
        bounds = search_clip_bounds(torch.exp(logp - old), adv, mask, config)
        out[str(dtype).removeprefix("torch.")] = {
            "c_low": bounds.c_low, "c_high": bounds.c_high, "rho": bounds.rho, "steps": bounds.steps,
            "loss": loss.item(), "grad": x.grad.double()}
    ref_grad = out["float64"]["grad"]
    for row in out.values():
        row["rho_abs_diff"] = abs(row["rho"] - out["float64"]["rho"])
        row["loss_rel_diff"] = abs(row["loss"] - out["float64"]["loss"]) / abs(out["float64"]["loss"])
        # relative to the largest gradient entry: the entries are ~1/tokens, so absolute numbers say little
        grad = row.pop("grad")
        row["grad_max_rel_diff"] = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
        row["grad_mean_rel_diff"] = ((grad - ref_grad).abs().mean() / ref_grad.abs().mean()).item()
        # tokens that one dtype clips (no gradient) and the other does not: a ratio on the other side of a bound
        row["clip_decisions_differ"] = ((grad == 0) != (ref_grad == 0)).double().mean().item()
    return out


def main_sizes(args) -> None:
    """Several sizes on one device, every variant on the PyTorch token pass (on CPU too)."""
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {device_name}, torch {torch.__version__}")
    with fused_cpu.disabled():
        sizes = [sized_timings(n, args.seq_len, args.repeats, args.device) for n in args.tokens]
        checks = numerics(args.tokens[0], args.seq_len, args.device)
    for row in sizes:
        print(f"tokens {row['tokens']:,}: bounds {row['bounds']} after {row['search_steps']} steps "
              f"(sequential: {row['sequential_steps']})")
        for k, v in row["ms"].items():
            print(f"  {k:<20} {v:9.3f} ms")
        for k, v in row["ratios"].items():
            print(f"  {k:<34} {v:6.2f}x")
    print("numerics against float64 (same batch; the log-probs in each dtype):")
    for dtype, row in checks.items():
        print(f"  {dtype:<9} bounds [{row['c_low']}, {row['c_high']}] rho {row['rho']:.6f} "
              f"(|diff| {row['rho_abs_diff']:.2e}) loss rel diff {row['loss_rel_diff']:.2e} "
              f"grad |diff| max {row['grad_max_rel_diff']:.1e} mean {row['grad_mean_rel_diff']:.1e} (of max, mean |grad|), "
              f"clip decisions differ on {row['clip_decisions_differ']:.1e} of tokens")
    RESULTS.mkdir(exist_ok=True)
    out = {"device": device_name, "torch": torch.__version__, "sizes": sizes, "numerics": checks,
           "command": f"python bench/loss_overhead.py --device {args.device} --repeats {args.repeats} "
           + " ".join(["--tokens", *map(str, args.tokens)])}
    stem = RESULTS / ("loss_overhead_cuda" if args.device == "cuda" else "loss_overhead_sizes_cpu")
    stem.with_suffix(".json").write_text(json.dumps(out, indent=2))
    plot_sizes(sizes, device_name, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png")


def plot_sizes(sizes: list[dict], device: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 3), squeeze=False)
    for ax, row in zip(axes[0], sizes):
        names = list(row["ms"])
        ax.barh(names, [row["ms"][n] for n in names], color=["#999", "#777", "#6b8", "#5c9", "#c44"])
        ax.set_xlabel(f"median ms per update, {row['tokens'] / 2**20:g}M tokens")
        ax.invert_yaxis()
        for y, n in enumerate(names):
            ax.text(row["ms"][n], y, f" {row['ms'][n]:.2f}", va="center")
    fig.suptitle(device)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1 << 20],
                        help="several sizes: each on the PyTorch path, timed by CUDA events on a GPU")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest numbers)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" or len(args.tokens) > 1:
        return main_sizes(args)
    args.tokens = args.tokens[0]
    torch.set_num_threads(args.threads)

    logp, old, adv, mask = make_batch(args.tokens, args.seq_len)
    config = BAPOConfig(measure="value")  # same measure as the sequential reference
    bapo_calls: list[int] = []
    seq_calls: list[int] = []
    bounds = search_clip_bounds(torch.exp(logp - old), adv, mask, config)
    seq_bounds = sequential_search(logp, old, adv, mask, config, [])
    assert (bounds.c_low, bounds.c_high) == seq_bounds[:2], (bounds, seq_bounds)

    # Interleave the variants so machine load hits them alike.
    rows = {"plain": [], "plain+stats": [], "bapo": [], "bapo (pytorch path)": [], "bapo search only": [],
            "sequential search": []}
    for _ in range(args.repeats):
        rows["plain"].append(timeit(lambda: plain_step(logp, old, adv, mask, False), 1))
        rows["plain+stats"].append(timeit(lambda: plain_step(logp, old, adv, mask, True), 1))
        bapo_calls.clear()
        rows["bapo"].append(timeit(lambda: bapo_step(logp, old, adv, mask, config, bapo_calls), 1))
        with fused_cpu.disabled():
            rows["bapo (pytorch path)"].append(timeit(lambda: bapo_step(logp, old, adv, mask, config, []), 1))
        rows["bapo search only"].append(
            timeit(lambda: search_clip_bounds(torch.exp(logp - old), adv, mask, config), 1))
        seq_calls.clear()
        rows["sequential search"].append(timeit(lambda: sequential_search(logp, old, adv, mask, config, seq_calls), 1))
    ms = {k: statistics.median(v) for k, v in rows.items()}

    print(f"tokens: {logp.numel():,} ({mask.sum().int():,} unmasked), torch threads: {torch.get_num_threads()}, "
          f"fused CPU token pass (numba): {'yes' if fused_cpu.available() else 'no'}")
    print(f"bounds: c_low={bounds.c_low} c_high={bounds.c_high} after {bounds.steps} search steps "
          f"(sequential: {seq_bounds[2]} steps, same bounds)")
    for k, v in ms.items():
        print(f"  {k:<18} {v:9.1f} CPU ms")
    ratios = {
        "bapo / plain": ms["bapo"] / ms["plain"],
        "bapo / plain+stats": ms["bapo"] / ms["plain+stats"],
        "bapo (pytorch path) / plain": ms["bapo (pytorch path)"] / ms["plain"],
        "sequential search / bapo search": ms["sequential search"] / ms["bapo search only"],
        "sequential search / bapo (search+loss)": ms["sequential search"] / ms["bapo"],
    }
    for k, v in ratios.items():
        print(f"  {k:<40} {v:6.2f}x")
    calls = {"bapo": len(bapo_calls) // 2, "sequential": len(seq_calls) // 2}
    print(f"  reduction calls per update: bapo {calls['bapo']}, sequential {calls['sequential']}")

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loss_overhead.json").write_text(json.dumps(
        {"tokens": logp.numel(), "fused_cpu": fused_cpu.available(), "ms": ms, "ratios": ratios,
         "reduction_calls": calls, "search_steps": bounds.steps}, indent=2))
    plot(ms, RESULTS / "loss_overhead.png")
    print(f"wrote {RESULTS / 'loss_overhead.json'} and {RESULTS / 'loss_overhead.png'}")


def plot(ms: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    names = list(ms)
    ax.barh(names, [ms[n] for n in names], color=["#999", "#777", "#2a7", "#6b8", "#5c9", "#c44"])
    ax.set_xlabel("median CPU ms per update (1M tokens)")
    ax.invert_yaxis()
    for y, n in enumerate(names):
        ax.text(ms[n], y, f" {ms[n]:.0f}", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
