"""What a vLLM engine start costs in the NeMo-RL tier by the state of vLLM's model-info cache
(`$VLLM_CACHE_ROOT/modelinfos/`), side by side in one run: each repeat starts a fresh interpreter per kind,
in turn, each building the tests' engine (the tiny Qwen2, float32, eager, the tests' worker extension) and
exiting; its CPU seconds (its children's included: vLLM inspects the model class in a fresh interpreter
when the cache misses) come from the kernel.

- own: the cache holds this vLLM release's entry (every engine start after the first in one environment);
- other release's: the entry another vLLM release wrote last (one file name in every release, another
  module hash: what the two trees' tiers did to each other in one ~/.cache/vllm);
- empty: a fresh machine's first engine start.

Run it with a NeMo-RL tier environment's Python (tests/support/nemo_rl_venv.sh builds one):
    .venv-nemo-rl/nemo-rl-main-2026-08-22/bin/python bench/vllm_engine_start.py [--repeats 3]   (~3 min)
Writes bench/results/vllm_engine_start.json.
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

ROOT = Path(__file__).resolve().parents[1]
ENTRY = "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json"

START_ENGINE = """
import os, sys
from tests.support.vllm_engine import ENGINE_ENV, WORKER_EXTENSION
os.environ.update(ENGINE_ENV)
from vllm import LLM
from vllm.v1.executor.uniproc_executor import UniProcExecutor
LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=16, skip_tokenizer_init=True,
    enable_prefix_caching=False, distributed_executor_backend=UniProcExecutor, worker_extension_cls=WORKER_EXTENSION,
    gpu_memory_utilization=0.5, seed=0)
os._exit(0)  # the engine's shutdown is not what is measured
"""


def start_engine(model_dir: Path, cache_root: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fresh interpreter that builds the engine with `cache_root`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", START_ENGINE, str(model_dir)], env=env, cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, time.monotonic() - started


def other_releases_entry(own: Path, target: Path) -> None:
    """The own entry with another module hash, as another vLLM release leaves it."""
    entry = json.loads(own.read_text())
    entry["hash"] = "another-release"
    target.mkdir(parents=True, exist_ok=True)
    (target / ENTRY).write_text(json.dumps(entry))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import vllm

    from tests.support.vllm_engine import write_tiny_qwen2

    results: dict[str, list[tuple[float, float]]] = {"own": [], "other release's": [], "empty": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_tiny_qwen2(tmp / "model")
        warm = tmp / "warm"
        start_engine(tmp / "model", warm)  # writes this release's entry
        own_entry = warm / "modelinfos" / ENTRY
        if not own_entry.is_file():
            sys.exit(f"vLLM {vllm.__version__} wrote no {own_entry}: its model-info cache moved; update this bench")
        for repeat in range(args.repeats):
            stale, empty = tmp / f"stale{repeat}", tmp / f"empty{repeat}"
            other_releases_entry(own_entry, stale / "modelinfos")
            for kind, root in (("own", warm), ("other release's", stale), ("empty", empty)):
                results[kind].append(start_engine(tmp / "model", root))
                print(f"repeat {repeat + 1}/{args.repeats}, {kind}: {results[kind][-1][0]:.1f} CPU-s", flush=True)

    median = {kind: (statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs))
              for kind, runs in results.items()}
    print(f"\nvLLM {vllm.__version__}, engine start, median of {args.repeats} (CPU-s, wall s):")
    for kind, (cpu, wall) in median.items():
        print(f"  {kind:16s} {cpu:6.1f} CPU-s {wall:6.1f} s   x{cpu / median['own'][0]:.2f} of own")
    out = ROOT / "bench" / "results" / "vllm_engine_start.json"
    out.write_text(json.dumps({"vllm": vllm.__version__, "repeats": args.repeats, "median": median,
                               "runs": results}, indent=1))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
