"""Is a path on a network filesystem? SQLite's locking is unreliable on NFS and Lustre (and refused on
Lustre mounted without `flock`), so an MLflow sqlite store there may fail with "database is locked" or
corrupt under concurrent readers (an `mlflow ui` beside the job). Read from /proc/mounts: the mount with
the longest mount point containing the path."""

from __future__ import annotations

import os
import re
from pathlib import Path

NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "fuse.glusterfs", "ceph", "fuse.ceph",
              "panfs", "wekafs", "fuse.sshfs", "9p")


def _unescape(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in octal (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str | Path, mounts_text: str | None = None) -> str | None:
    if mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:
            return None  # not Linux: unknown
    target = os.path.abspath(path)
    best, best_type = "", None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point, fs_type = _unescape(fields[1]), fields[2]
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fs_type
    return best_type


def network_filesystem(path: str | Path, mounts_text: str | None = None) -> str | None:
    """The filesystem type when `path` is on a network filesystem, else None."""
    fs_type = filesystem_type(path, mounts_text)
    return fs_type if fs_type in NETWORK_FS else None
