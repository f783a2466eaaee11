"""The kept simulations of `bapo-nemo check` (plan/simulation/sim_cache.py): a result read back from disk equals a
fresh run of the plain function; the key follows the arguments and the code (every bapo_nemo module the
simulator imports, as Python itself loads them); the shipped results cover every shipped run of `check`
with the current code, and equal fresh runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bapo_nemo.plan import precompute
from bapo_nemo.plan.simulation import async_generation, generation, sim_cache, simulations
from bapo_nemo.plan.simulation.async_generation import AsyncSetting
from bapo_nemo.plan.simulation.engine_sim import Engine
from bapo_nemo.plan.simulation.search_stats import LengthModel
from bapo_nemo.plan.simulation.step_time import TrainCost
from bapo_nemo.rollout.config import PartialRolloutConfig

MS = 1e-3
ENGINE = Engine(gpus=1, weight_bytes=1e9, kv_bytes_per_token=1e5, kv_tokens=10**6, max_num_seqs=1024,
                hbm_bytes_per_s=1e12, flops_per_s=1e12, dense_flops_per_token=1e8, attention_flops_per_key=0.0)
SHAPE = generation.RolloutShape(engines=2, engine=ENGINE, prompts_per_step=4, group_size=4, prompt_tokens=10,
                                max_new_tokens=300, max_model_len=400, validation_samples=8, validation_batch=4)
LENGTHS = LengthModel(300, median=80, sigma=0.8)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """An empty cache directory, the shipped results ignored, nothing held in this process."""
    monkeypatch.setenv(sim_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(sim_cache, "use_shipped", False)
    sim_cache.forget()
    yield tmp_path
    sim_cache.forget()


CASES = [
    (simulations.simulate_without_partial, generation.simulate_without_partial, (SHAPE, LENGTHS), {"steps": 3}),
    (simulations.simulate_partial, generation.simulate_partial,
     (SHAPE, LENGTHS, PartialRolloutConfig(token_budget=64)), {"steps": 3}),
    (simulations.simulate_validation, generation.simulate_validation, (SHAPE, LENGTHS), {}),
    (simulations.response_moments, generation.response_moments, (SHAPE, LENGTHS), {"draws": 500}),
    (simulations.simulate_async, async_generation.simulate_async,
     (SHAPE, LENGTHS, AsyncSetting(2, True), TrainCost(1e-4, 1e-8), 10 * MS), {"steps": 3}),
]


@pytest.mark.parametrize("kept,plain,args,kwargs", CASES, ids=[c[1].__name__ for c in CASES])
def test_a_result_read_back_from_disk_equals_a_fresh_run(own_cache, kept, plain, args, kwargs):
    first = kept(*args, **kwargs)
    assert len(sim_cache.misses) == 1 and len(list(own_cache.glob("*.json"))) == 1
    sim_cache.forget()  # only the file is left
    again = kept(*args, **kwargs)
    assert sim_cache.misses == [], "the second call must be a hit"
    fresh = plain(*args, **kwargs)
    assert again == fresh and first == fresh and type(again) is type(fresh)


def test_the_key_follows_the_arguments_not_how_they_are_spelled(own_cache):
    f = generation.simulate_without_partial
    key = sim_cache.cache_key(f, (SHAPE, LENGTHS), {"steps": 3})
    assert key == sim_cache.cache_key(f, (SHAPE,), {"lengths": LENGTHS, "steps": 3, "seed": 0})
    assert key != sim_cache.cache_key(f, (SHAPE, LENGTHS), {"steps": 4})
    assert key != sim_cache.cache_key(f, (SHAPE, LENGTHS), {"steps": 3, "seed": 1})


def test_no_cache_directory_keeps_nothing_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(sim_cache.CACHE_ENV, "off")
    monkeypatch.chdir(tmp_path)
    sim_cache.forget()
    simulations.response_moments(SHAPE, LENGTHS, draws=100)
    sim_cache.forget()
    simulations.response_moments(SHAPE, LENGTHS, draws=100)
    assert len(sim_cache.misses) == 1 and list(tmp_path.iterdir()) == []


def _loaded_by_python(module: str) -> set[str]:
    """The bapo_nemo files importing `module` loads, in a fresh interpreter."""
    program = (f"import sys, {module}\n"
               "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.startswith('bapo_nemo')))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    return {str(Path(p).resolve()) for p in done.stdout.split()}


@pytest.mark.parametrize("module", sorted({f.__module__ for _, f, _, _ in CASES} | {"bapo_nemo.plan.simulation.search_stats"}))
def test_the_code_version_covers_every_module_python_loads_for_the_simulator(module):
    closure = {str(p.resolve()) for p in sim_cache.source_closure(module)}
    missing = _loaded_by_python(module) - closure
    assert not missing, f"{module}'s key would not change with: {sorted(missing)}"


def test_an_edit_to_an_imported_module_changes_the_version_of_its_importers_only(tmp_path, monkeypatch):
    copy = tmp_path / "bapo_nemo"
    shutil.copytree(sim_cache.PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def versions() -> tuple[str, str]:
        sim_cache.code_version.cache_clear()
        sim_cache._imports.cache_clear()
        return (sim_cache.code_version("bapo_nemo.plan.simulation.async_generation"),
                sim_cache.code_version("bapo_nemo.plan.simulation.search_stats"))

    monkeypatch.setattr(sim_cache, "PACKAGE_ROOT", copy)
    try:
        before = versions()
        engine_sim = copy / "plan" / "simulation" / "engine_sim.py"
        text = engine_sim.read_text()
        engine_sim.write_text('"""Other words."""\n# a comment\n' + text.split('"""', 2)[2].replace("\n\n", "\n# more\n\n", 3))
        prose_only = versions()
        engine_sim.write_text(text.replace("ALLREDUCE_LATENCY_S = 10e-6", "ALLREDUCE_LATENCY_S = 11e-6"))
        after = versions()
    finally:
        monkeypatch.undo()
        versions()
    assert prose_only == before, "a docstring and comments are not the code"
    assert after[0] != before[0], "async_generation imports engine_sim through live_engine"
    assert after[1] == before[1], "search_stats imports nothing of the engine"


@pytest.mark.parametrize("name", sorted(precompute.PRESET_RUNS))
def test_the_shipped_results_cover_every_shipped_run(name, monkeypatch):
    """A first `check` of a shipped run simulates nothing; when this fails, the code changed since
    precomputed.json was written: run `python -m bapo_nemo.plan.precompute`."""
    monkeypatch.setenv(sim_cache.CACHE_ENV, "off")
    sim_cache.forget()
    precompute.run_check_quietly(precompute.check_argv(name))
    assert sim_cache.calls, "check ran no simulation"
    assert sim_cache.misses == [], (f"{len(sim_cache.misses)} of {len(sim_cache.calls)} simulations of {name} are "
                                    "not in bapo_nemo/plan/simulation/precomputed.json: run `python -m bapo_nemo.plan.precompute`")


def test_shipped_results_equal_fresh_runs(monkeypatch):
    """bapo_32b_partial's every simulation but the async ones (one of those: each takes ~0.2 s), run again
    without the cache."""
    monkeypatch.setenv(sim_cache.CACHE_ENV, "off")
    sim_cache.forget()
    precompute.run_check_quietly(precompute.check_argv("bapo_32b_partial"))
    assert sim_cache.misses == []
    calls = sorted(sim_cache.calls.items())
    asynchronous = [item for item in calls if item[1][0] is async_generation.simulate_async]
    chosen = [item for item in calls if item[1][0] is not async_generation.simulate_async] + asynchronous[:1]
    assert len(chosen) >= 6 and asynchronous
    for key, (fn, args, kwargs) in chosen:
        assert sim_cache.result(key) == fn(*args, **kwargs), fn.__name__
