"""A free TCP port for a test's server process: outside the kernel's ephemeral range, and leased to the
process that picked it so that no other test process on the machine picks it while that one lives."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LEASES = Path(tempfile.gettempdir()) / f"bapo-nemo-test-ports-{os.getuid()}"
_held: list[int] = []  # this process's lease descriptors: the kernel drops each lock when the process ends


def free_port() -> int:
    """A port free at this moment on every address, below the ephemeral range, and leased to this process.

    Below the ephemeral range: a port the kernel hands out for port 0 (Ray's GCS, raylet and agents bind 0)
    or for an outgoing connection can never be ours (a Ray head's client server once lost its port to the
    head's own raylet). The lease: a server needs seconds from our pick to its bind, and stops and restarts
    on the same port; in that window another pytest (the two NeMo-RL trees run side by side) once picked the
    same port and its MLflow server died with "address already in use". A lease is an flock on a file per
    port, held until this process exits, so every process picking here skips it whatever their timing."""
    low = _ephemeral_low()
    LEASES.mkdir(exist_ok=True)
    for _ in range(400):
        port = random.randrange(max(1024, low - 12000), low)
        if _bindable(port) and _lease(port):
            return port
    raise RuntimeError(f"no free TCP port below the ephemeral range ({low}) after 400 tries "
                       f"(leases in {LEASES})")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def _lease(port: int) -> bool:
    fd = os.open(LEASES / str(port), os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a live process holds it (this one included: a second pick is a second server)
        os.close(fd)
        return False
    _held.append(fd)
    return True


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
