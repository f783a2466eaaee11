"""How long `bapo-nemo check` takes per shipped run, with every simulation run (what check did before its
results were kept) and with the kept results (plan/simulation/sim_cache.py), side by side in one run: each repeat
starts a fresh `python -m bapo_nemo.cli check ...` of each kind in turn, so both see the same load.

- simulated: no kept result read or written (BAPO_NEMO_CACHE_DIR=off, precomputed.json ignored);
- shipped: a first check after installing (an empty cache directory; precomputed.json read);
- and one run the shipped file does not hold (bapo_32b on H200): its first check (it simulates and keeps
  the results) against the second (it reads them).
Both kinds print the same text; the script stops if they do not.

    python bench/check_latency.py [--repeats 3]       (~2 min on the shared 2-core machine)
Writes bench/results/check_latency.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bapo_nemo.plan.precompute import PRESET_RUNS, check_argv

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "check_latency.json"
PROGRAM = ("import sys\nfrom bapo_nemo.plan.simulation import sim_cache\nsim_cache.use_shipped = sys.argv[1] == 'on'\n"
           "from bapo_nemo.cli import main\nsys.exit(main(['check', *sys.argv[2:]]))")
NOT_SHIPPED = [str(ROOT / "configs" / "bapo_32b.yaml"), "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h200-141gb"]


def timed(argv: list[str], shipped: bool, cache_dir: str) -> tuple[float, float, str]:
    """(wall s, CPU s, stdout) of one check in a fresh interpreter."""
    env = {**os.environ, "BAPO_NEMO_CACHE_DIR": cache_dir, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROGRAM, "on" if shipped else "off", *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def measure(runs: dict[str, list[str]], repeats: int) -> dict[str, dict]:
    samples = {name: {"simulated": [], "kept": []} for name in [*runs, "not_shipped"]}
    for _ in range(repeats):
        for name, argv in runs.items():
            with tempfile.TemporaryDirectory() as empty:
                cold = timed(argv, False, "off")
                kept = timed(argv, True, empty)
            if cold[2] != kept[2]:
                raise SystemExit(f"{name}: check printed different text with the kept results")
            samples[name]["simulated"].append(cold[:2])
            samples[name]["kept"].append(kept[:2])
        with tempfile.TemporaryDirectory() as cache:
            first, again = timed(NOT_SHIPPED, False, cache), timed(NOT_SHIPPED, False, cache)
        if first[2] != again[2]:
            raise SystemExit("not_shipped: check printed different text from its kept results")
        samples["not_shipped"]["simulated"].append(first[:2])
        samples["not_shipped"]["kept"].append(again[:2])
    out = {}
    for name, kinds in samples.items():
        row = {f"{kind}_{what}_s": statistics.median(s[i] for s in values)
               for kind, values in kinds.items() for i, what in enumerate(("wall", "cpu"))}
        row["wall_ratio"] = row["simulated_wall_s"] / row["kept_wall_s"]
        row["cpu_ratio"] = row["simulated_cpu_s"] / row["kept_cpu_s"]
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = {name: check_argv(name) for name in PRESET_RUNS}
    rows = measure(runs, args.repeats)
    print(f"{'run':<18} {'simulated wall/CPU s':>21} {'kept wall/CPU s':>17} {'ratio wall/CPU':>15}")
    for name, r in rows.items():
        print(f"{name:<18} {r['simulated_wall_s']:>10.2f} /{r['simulated_cpu_s']:>6.2f} {r['kept_wall_s']:>8.2f} "
              f"/{r['kept_cpu_s']:>5.2f} {r['wall_ratio']:>9.1f}x /{r['cpu_ratio']:>4.1f}x")
    print(f"medians of {args.repeats}; load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    RESULTS.write_text(json.dumps({"repeats": args.repeats, "load_average": os.getloadavg()[0],
                                   "cpus": os.cpu_count(), "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
