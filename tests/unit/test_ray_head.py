"""The private Ray head that the NeMo-RL CPU tests run on (tests/support/ray_head.py), started for real: a head
that dies while starting says why, and is started again; the head that comes up is ours and joinable."""

from __future__ import annotations

import socket

import pytest

from tests.support import ray_head

ray = pytest.importorskip("ray", reason="Ray comes with the nemo-cpu extra")


@pytest.fixture
def taken_port():
    """A port another process listens on, handed to the head as its client server's port: the head's
    client server cannot bind it, and `ray start --block` stops the whole head."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_head_that_dies_while_starting_fails_with_its_processes_logs(monkeypatch, taken_port):
    monkeypatch.setattr(ray_head, "free_port", lambda: taken_port)
    monkeypatch.setattr(ray_head, "START_ATTEMPTS", 1)
    with pytest.raises(RuntimeError) as failed, ray_head.private_ray_head(num_cpus=1, num_gpus=0):
        pass
    assert "ray_client_server [exit code=1]" in str(failed.value)
    assert f"Failed to bind to address 127.0.0.1:{taken_port}" in str(failed.value)


def test_a_head_that_dies_while_starting_is_started_again(monkeypatch, taken_port):
    picks = [taken_port]
    free = ray_head.free_port
    monkeypatch.setattr(ray_head, "free_port", lambda: picks.pop() if picks else free())
    with ray_head.private_ray_head(num_cpus=3, num_gpus=1) as address:
        ray.init(address=address, log_to_driver=False)
        try:
            resources = ray.cluster_resources()
        finally:
            ray.shutdown()
    assert picks == []  # the first attempt was given the taken port
    assert (resources["CPU"], resources["GPU"]) == (3, 1)  # this head, not another on the machine
