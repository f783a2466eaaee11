"""A free TCP port for a test's server process."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free at this moment. Another process can bind it before the caller's server does: a server
    that accepts port 0 should take that instead (tests/support/ray_head.py), and one started on this port must
    fail loudly, with its log, if the port was taken (a file rendezvous needs no port at all)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
