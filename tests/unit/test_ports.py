"""tests/support/ports.py: a test server's port is one no port-0 bind or outgoing connection can take."""

from __future__ import annotations

import socket

from tests.support.ports import _ephemeral_low, free_port


def test_the_port_is_free_and_below_every_port_the_kernel_hands_out_for_port_0():
    port = free_port()
    assert 1024 <= port < _ephemeral_low()
    with socket.socket() as server:
        server.bind(("", port))  # free on every address
    handed_out = []
    for _ in range(50):  # the premise: port-0 binds (Ray's GCS, raylet, agents) stay in the ephemeral range
        with socket.socket() as s:
            s.bind(("", 0))
            handed_out.append(s.getsockname()[1])
    assert min(handed_out) >= _ephemeral_low()


def test_a_taken_port_is_never_picked(monkeypatch):
    low = _ephemeral_low()
    picks = iter([low - 1, low - 2])  # the first is taken below
    monkeypatch.setattr("tests.support.ports.random.randrange", lambda start, stop: next(picks))
    with socket.socket() as taken:
        taken.bind(("", low - 1))
        taken.listen()
        assert free_port() == low - 2
