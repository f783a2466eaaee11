"""The warm parent of a private head's Ray workers (tests/support/ray_zygote.py): a worker forked from it is
the worker Ray would have started (its environment, arguments, directory, thread count, identity in Ray),
a kill reaches it whoever sends it, and a worker whose environment differs in what the warm parent's
imports read is started by Ray itself."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tests.support.ray_head import private_ray_head

pytestmark = pytest.mark.skipif(not os.environ.get("NEMO_RL_SRC"), reason="the NeMo-RL tier's heads use the zygote")


def _describe():
    import psutil
    import torch

    helper = psutil.Process(os.getppid())
    return {
        "pid": os.getpid(),
        "grandparent": helper.ppid(),
        "parent_name": helper.name(),
        "argv0": sys.argv[0],
        "cwd": os.getcwd(),
        "marker": os.environ.get("BAPO_TEST_MARKER"),
        "hf_home": os.environ.get("HF_HOME"),
        "threads": torch.get_num_threads(),
        "job_id": os.environ.get("RAY_JOB_ID"),
    }


class Probe:
    """A Ray actor (made one per test, with that test's options)."""

    def describe(self):
        return _describe()

    def wait(self, seconds):
        time.sleep(seconds)
        return seconds


@pytest.fixture(scope="module")
def head():
    import json

    import ray

    with private_ray_head(num_cpus=4, num_gpus=0) as address:
        ray.init(address=address, log_to_driver=False)
        socket_path = ray.get(ray.remote(lambda: os.environ["BAPO_TEST_RAY_ZYGOTE"]).remote())
        with open(f"{socket_path}.json") as f:
            zygote_pid = json.load(f)["pid"]
        yield ray, zygote_pid
        ray.shutdown()


def test_a_worker_is_forked_from_the_zygote_and_is_what_ray_would_start(head):
    ray, zygote_pid = head

    probe = ray.remote(num_cpus=1)(Probe)
    forked = ray.get(probe.options(runtime_env={"env_vars": {"BAPO_TEST_MARKER": "forked"}}).remote().describe.remote())
    assert forked["grandparent"] == zygote_pid  # zygote -> helper -> worker
    assert forked["argv0"].endswith(os.path.join("ray", "_private", "workers", "default_worker.py"))
    assert forked["marker"] == "forked"  # the runtime_env's variable, set by Ray for this worker only
    assert forked["job_id"]  # Ray's per-worker variables reach Ray's own C++ core (it registered)

    # HF_HOME is read when transformers is imported: that worker is started by Ray, not forked
    started = ray.get(probe.options(runtime_env={"env_vars": {"HF_HOME": "/nonexistent/hf"}}).remote().describe.remote())
    assert started["grandparent"] != zygote_pid and started["parent_name"] == "raylet"
    assert started["hf_home"] == "/nonexistent/hf"
    assert (forked["cwd"], forked["threads"]) == (started["cwd"], started["threads"])


def test_a_sigkilled_forked_worker_is_a_dead_actor_in_ray(head):
    ray, _ = head

    actor = ray.remote(num_cpus=1)(Probe).remote()
    pid = ray.get(actor.describe.remote())["pid"]
    pending = actor.wait.remote(600)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(pending, timeout=120)


def test_a_variable_safe_to_differ_is_unsafe_once_the_zygotes_imports_read_it(head):
    """The client's rule, on the running zygote's own description: Ray's per-worker variables may differ,
    any variable the zygote's imports looked up (HF_HOME: transformers) may not, safe-listed or not."""
    import json

    ray, _ = head
    from tests.support.nemo_rl_shim.ray_zygote_client import unsafe_differences

    socket_path = ray.get(ray.remote(lambda: os.environ["BAPO_TEST_RAY_ZYGOTE"]).remote())
    with open(f"{socket_path}.json") as f:
        zygote = json.load(f)
    assert "HF_HOME" in zygote["read_at_import"]
    env = zygote["env"]
    assert unsafe_differences(zygote, {**env, "RAY_JOB_ID": "07000000", "RANK": "3"}) == []
    assert unsafe_differences(zygote, {**env, "HF_HOME": "/elsewhere"}) == ["HF_HOME"]
    assert unsafe_differences({**zygote, "read_at_import": ["RANK"]}, {**env, "RANK": "3"}) == ["RANK"]


def test_a_default_the_zygotes_imports_set_is_no_difference_when_the_worker_holds_it(head):
    """scikit-learn sets KMP_DUPLICATE_LIB_OK=True where it is unset (os.environ.setdefault, a lookup): for a
    zygote that started without it, a worker whose driver's imports set the same default is forked, and
    another value is a difference."""
    import json

    ray, _ = head
    from tests.support.nemo_rl_shim.ray_zygote_client import unsafe_differences

    socket_path = ray.get(ray.remote(lambda: os.environ["BAPO_TEST_RAY_ZYGOTE"]).remote())
    with open(f"{socket_path}.json") as f:
        zygote = json.load(f)
    assert "KMP_DUPLICATE_LIB_OK" in zygote["read_at_import"]
    env = {k: v for k, v in zygote["env"].items() if k != "KMP_DUPLICATE_LIB_OK"}
    started_without = {**zygote, "env": env, "set_at_import": {**zygote["set_at_import"], "KMP_DUPLICATE_LIB_OK": "True"}}
    assert unsafe_differences(started_without, {**env, "KMP_DUPLICATE_LIB_OK": "True"}) == []
    assert unsafe_differences(started_without, {**env, "KMP_DUPLICATE_LIB_OK": "False"}) == ["KMP_DUPLICATE_LIB_OK"]
    assert unsafe_differences(zygote, {**env, "HF_HOME": "/elsewhere", "KMP_DUPLICATE_LIB_OK": "True"}) == ["HF_HOME"]
