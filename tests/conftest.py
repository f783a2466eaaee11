"""Shared test set-up: markers that skip with their reason where the hardware or software is absent, and
how the suite runs in parallel (pytest-xdist, `-n auto --dist loadgroup` in pyproject.toml): which tests
share a worker, how many workers, one build of an expensive fixture for all of them, and each test's
environment variables put back after it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import settings

from tests.support.ray_head import SESSION_ZYGOTE_ENV

# Fixtures more than one tier uses (the checkpoint-integrity and tracking tests, with NeMo-RL and without).
pytest_plugins = ["tests.support.checkpoints", "tests.support.nemo_tracking", "tests.support.signals"]

# CI explores a fixed set of examples (the same on every run), so a landing never hinges on a random
# draw; developers' runs keep exploring new ones.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# One intra-op thread per process: xdist runs two workers per core (WORKERS_PER_CPU), each starting
# trainers, CLIs and Ray actors, so every core is shared already; more threads spin-wait on busy cores
# (measured: the suite used ~260 CPU-s more with torch's default of one thread per core). Set before
# anything imports torch, and inherited by every subprocess and Ray worker. A test that needs more threads
# sets them itself.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")
# Every Ray cluster the tests start (private heads, local ones) reads these from its environment:
# - workers at the tests' priority: Ray starts its workers at niceness 15, below a cluster node's driver;
#   here the other tests' processes (nice 0) starve them (a GRPO test of 9 s alone took 335 s beside four
#   busy loops, 25 s with this);
# - no idle Python workers started ahead of need (one per logical CPU: 24 for the Megatron rehearsal's
#   head): NeMo-RL's actors carry their own runtime environment and never use them.
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# - Ray's memory monitor kills a worker once 95% of the machine's memory is in use, whoever uses it: on a
#   24 GB CI machine running the tiers at once, the other tests' processes included, that is a lost
#   rehearsal, not a protection of the cluster.
os.environ.setdefault("RAY_memory_usage_threshold", "0.99")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `bapo-nemo check`'s kept simulations (bapo_nemo/plan/simulation/sim_cache.py): one directory for every worker and
# run of the suite, not the developer's ~/.cache. A result is keyed by its code, so reuse is safe.
os.environ.setdefault("BAPO_NEMO_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"bapo-nemo-check-cache-{os.getuid()}"))

# NeMo-RL from source (NEMO_RL_SRC, set per tree by tests/suite.sh): the shim puts the source on sys.path
# (and, on Python < 3.12, aliases typing.TypedDict/NotRequired). Run it here for this process, and put its folder (and this checkout) on
# PYTHONPATH so every subprocess and Ray worker the tests start runs it at start-up too.
_TESTS = Path(__file__).resolve().parent
_SHIM_DIR = Path(__file__).parent / "support" / "nemo_rl_shim"
_REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_nemo_rl_shim", _SHIM_DIR / "sitecustomize.py")
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
if os.environ.get("NEMO_RL_SRC"):
    _paths = [str(_SHIM_DIR), str(_REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(_paths))
    # torch.compile off in every process of the tier, as the vLLM engine needs it (its compiled helpers
    # cost minutes of CPU for a model that runs in milliseconds): one value for all, so the engine's
    # actors fork from the Ray workers' warm parent too (torch reads it at import: tests/support/ray_zygote.py)
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    # vLLM's cache in this environment, not the developer's ~/.cache/vllm (NeMo-RL's engines use this root plus
    # `_<seed>`): an engine start whose model-info entry is missing or another vLLM's (the same file name in
    # every release, another hash) inspects the model class in a fresh interpreter, ~12 CPU-s. With the two
    # trees' vLLM releases in one ~/.cache each overwrote the other's entry.
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(sys.prefix, "vllm-cache"))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001  # pragma: no cover - torch is a hard dependency
        return False


def _has_nemo_rl() -> bool:
    """An installed nemo_rl (the container) or a source checkout in NEMO_RL_SRC (CI: .ci/run sets it)."""
    try:
        return importlib.util.find_spec("nemo_rl") is not None
    except (ImportError, ValueError):
        return False


def _skip_where_absent(items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: runs inside the NeMo-RL container on the cluster")
    skip_nemo = pytest.mark.skip(
        reason="needs NeMo-RL: an installed nemo_rl (nvcr.io/nvidia/nemo-rl) or a source tree in NEMO_RL_SRC with "
        "the `nemo-cpu` extra installed (tests/suite.sh runs these once per tree in NEMO_RL_SRCS, which .ci/run "
        "sets from ../shared/upstream)"
    )
    cuda, nemo = _has_cuda(), _has_nemo_rl()
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)
        if "nemo_rl" in item.keywords and not nemo:
            item.add_marker(skip_nemo)



# ---- parallel runs (pytest-xdist) -------------------------------------------------------------------------
# Modules whose tests must run one after another in one worker process, in file order, and apart from each
# other's groups. The rest of the suite spreads over the workers test by test, except that a module with a
# module-scoped fixture keeps its tests together (the fixture is built once, not once per worker).
XDIST_GROUPS = {
    # NeMo-RL in-process: Ray clusters (a head per module, a local one per test), MLflow's fluent API (a
    # process follows the first tracking URI it is given), the driver's signal handlers.
    "nemo_rl/test_driver_e2e.py": "nemo-rl-in-process",
    "nemo_rl/test_partial_rollout_grpo.py": "nemo-rl-in-process",
    "nemo_rl/test_tracking.py": "nemo-rl-in-process",
    "nemo_rl/test_tracking_faults.py": "nemo-rl-in-process",
    "nemo_rl/test_step_signal.py": "nemo-rl-in-process",
    # The Megatron rehearsal in a worker of its own, beside the group above (its Ray head is private and
    # its driver a subprocess): 17 Ray actors, ~9 GB at its peak, and the suite's longest module, which
    # would otherwise queue behind the whole group.
    "nemo_rl/test_megatron_rehearsal.py": "nemo-rl-megatron",
    # The async rehearsal (8 Ray actors, its own private head and driver subprocess) in the same worker, one
    # after the other: run beside a Megatron rehearsal on a 23 GB machine, Ray's memory monitor killed one
    # of its workers at 95% of memory.
    "nemo_rl/test_async_rehearsal.py": "nemo-rl-megatron",
    # The fault rehearsal (five driver attempts on a private head, ~5 Ray actors each) after them in the same
    # worker: beside them it slowed both to 2-3x (a CI tier took 788 s instead of 454) on two cores.
    "nemo_rl/test_fault_rehearsal.py": "nemo-rl-megatron",
}


def _mark_the_nemo_rl_tier(item: pytest.Item, module: str) -> None:
    """The folder decides the tier: every test in tests/nemo_rl/ is marked nemo_rl (tests/suite.sh runs them
    once per NeMo-RL tree), and no test elsewhere may be, or the Python 3.11 suite would skip it for good."""
    if module.startswith("nemo_rl/"):
        item.add_marker(pytest.mark.nemo_rl)
    elif item.get_closest_marker("nemo_rl") is not None:
        raise pytest.UsageError(f"{item.nodeid} is marked nemo_rl outside tests/nemo_rl/: move it there")


def _tier_path(path: Path) -> str:
    """A test module's path inside tests/ (e.g. nemo_rl/test_driver_e2e.py): what XDIST_GROUPS keys."""
    return path.relative_to(_TESTS).as_posix()


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    fixtures = getattr(item, "_fixtureinfo", None)
    return fixtures is not None and any(
        defs[-1].scope == "module" for defs in fixtures.name2fixturedefs.values() if defs
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects and xdist reads the marks (it appends the group to ids)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = _tier_path(item.path)
        _mark_the_nemo_rl_tier(item, module)
        group = XDIST_GROUPS.get(module) or (module if _uses_a_module_fixture(item) else None)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    _skip_where_absent(items)


def pytest_xdist_node_collection_finished(node, ids):
    """Stop at once if this pytest/xdist pair ignores the groups (pytest 9.2 with xdist 3.8: pytest-xdist
    issue 1386), rather than run Ray or Slurm tests side by side and fail at random. xdist shows a test's
    group as an "@group" suffix of the id a worker reports."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [i for i in ids if i.partition("::")[0].removeprefix("tests/") in XDIST_GROUPS and "@" not in i]
    if lost:
        pytest.exit(
            f"pytest-xdist does not group {lost[0]} (and {len(lost) - 1} more): this pytest/pytest-xdist "
            "pair ignores xdist_group; install with -c constraints/cpu-py311.txt, or run with -n 0",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: PYTEST_XDIST_AUTO_NUM_WORKERS if set, else WORKERS_PER_CPU per CPU this process may use.
    Most slow tests wait on subprocesses (a CLI, a trainer, an MLflow server, Slurm's scheduler), so more
    workers than cores keeps the cores busy."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return WORKERS_PER_CPU * len(os.sched_getaffinity(0))


WORKERS_PER_CPU = 2


def _mlflow_tracking_uri() -> str | None:
    """The tracking URI MLflow's fluent API follows in this process, if a test has loaded MLflow."""
    mlflow = sys.modules.get("mlflow")
    return mlflow.get_tracking_uri() if mlflow is not None and mlflow.is_tracking_uri_set() else None


# What the session starts once for all its tests, named in the environment for the processes they start:
# the Ray workers' warm parent (tests/support/ray_head.py).
SESSION_WIDE = (SESSION_ZYGOTE_ENV,)


@pytest.fixture(scope="module", autouse=True)
def _environment_put_back_after_the_module():
    """The same for a module's own fixtures (autouse ones start first and end last in their scope): e.g.
    `ray.init()` in one exports PYTHONBREAKPOINT and RAY_USAGE_STATS_ENABLED for good, and every later
    `bapo-nemo` call in that worker would then be exec'd (tests/support/cli_process.py)."""
    environment = dict(os.environ)
    yield
    _put_back(environment)


@pytest.fixture(autouse=True)
def _environment_put_back():
    """What a test sets process-wide must not change what later tests in the same worker, or the
    subprocesses they start, see: environment variables, and MLflow's fluent API, which follows the first
    tracking URI a process is given (NeMo-RL's MLflowLogger sets it only when none is set, and exports it
    as MLFLOW_TRACKING_URI) and keeps a run active until it is ended."""
    environment, tracking_uri = dict(os.environ), _mlflow_tracking_uri()
    yield
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        if mlflow.active_run() is not None:
            mlflow.end_run()
        if _mlflow_tracking_uri() != tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)  # None: back to "not set" (MLflow then reads the env)
    _put_back(environment)


def _put_back(environment: dict) -> None:
    """os.environ as `environment`, but for what serves the whole session (SESSION_WIDE)."""
    kept = {k: os.environ[k] for k in SESSION_WIDE if k in os.environ}
    if os.environ != {**environment, **kept}:
        os.environ.clear()
        os.environ.update({**environment, **kept})


@pytest.fixture(autouse=True)
def _no_cpu_megatron_shim():
    """tests/support/nemo_rl_shim/megatron_cpu.py patches torch for its whole process (CUDA calls on CPU) and serves
    a stub `megatron.bridge`; it belongs in the processes that run NeMo-RL's Megatron worker code, never in
    a pytest worker, where every later test would see it (it once changed the export tests' parity figures
    and their Megatron-Bridge check). A test that installs it here fails, whichever way it got in (importing
    tests/support/nemo_megatron_standins.py, or Ray loading a worker class from it in a driver)."""

    def installed() -> bool:
        shim = sys.modules.get("tests.support.nemo_rl_shim.megatron_cpu")
        return shim is not None and shim._INSTALLED

    before = installed()
    yield
    if installed() and not before:  # the test that installed it fails; later ones would only repeat it
        pytest.fail(
            "this test installed the CPU Megatron shim (tests/support/nemo_rl_shim/megatron_cpu.py) in the pytest "
            "process; run the code that needs it in a subprocess (e.g. tests/support/nemo_megatron_rehearsal_run.py)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def built_once(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """`built_once(key, build)`: a directory that `build(path)` fills once per session, for every xdist
    worker: the first to ask builds it while the others wait on a file lock, then all read it. `key` must
    name what the build depends on (e.g. a hash of its config). A build that raises leaves nothing behind,
    so each later asker builds again and fails the same way. Readers must not change the directory: copy
    it first."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory; each worker's own is a folder in it
    root = root / "built_once"
    root.mkdir(exist_ok=True)

    def get(key: str, build: Callable[[Path], None]) -> Path:
        target, done = root / key, root / f"{key}.done"
        with FileLock(str(root / f"{key}.lock")):
            if not done.is_file():
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
                try:
                    build(target)
                except BaseException:
                    shutil.rmtree(target, ignore_errors=True)
                    raise
                done.touch()
        return target

    return get


@pytest.fixture(scope="session")
def trained(built_once) -> Path:
    """A finished 3-step tiny run with checkpoints step_0..step_3, trained once for all workers and shared by
    the user-error, user-run and race tests (each copies it before changing it)."""
    from tests.support.tiny_run import TINY_RUN_KEY, train_tiny_run

    return built_once(f"trained-run-{TINY_RUN_KEY}", train_tiny_run) / "run"
