"""tests/support/ports.py: a test server's port is one no port-0 bind, outgoing connection or other test
process can take."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
from pathlib import Path

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


def _picker_process() -> tuple[subprocess.Popen, int]:
    """Another process (another pytest, say) that picked a port and lives on, its server not yet bound."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tests.support.ports import free_port; print(free_port(), flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    return proc, int(proc.stdout.readline())


def test_a_port_another_live_process_picked_is_skipped_until_that_process_ends(monkeypatch):
    """The window between a pick and its server's bind (seconds for an MLflow server), and a stopped server
    waiting for its restart: the port is free to bind yet must not be handed out again."""
    other, leased = _picker_process()
    try:
        with socket.socket() as s:
            s.bind(("", leased))  # nothing listens on it: a bind probe alone would hand it out
        picks = itertools.chain([leased], range(leased - 1, 1023, -1))
        monkeypatch.setattr("tests.support.ports.random.randrange", lambda start, stop: next(picks))
        assert free_port() != leased
    finally:
        other.communicate("\n", timeout=30)
    monkeypatch.setattr("tests.support.ports.random.randrange", lambda start, stop: leased)
    assert free_port() == leased  # the lease died with its process


def test_one_process_never_gets_the_same_port_twice(monkeypatch):
    first = free_port()
    picks = itertools.chain([first], range(first - 1, 1023, -1))
    monkeypatch.setattr("tests.support.ports.random.randrange", lambda start, stop: next(picks))
    assert free_port() != first
