"""A free TCP port for a test's server process, outside the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port free at this moment on every address, below the ephemeral range: a port the kernel hands out for
    port 0 (Ray's own GCS, raylet and agents bind 0) or for an outgoing connection can never be ours, so a
    process of the same server cannot take it between our pick and the server's bind (a Ray head's client
    server once lost its port to the head's own raylet and the whole head died). Another test's pick can still
    coincide: a server started on this port must fail loudly, with its log."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port below the ephemeral range ({low}) after 200 tries")


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
