"""Runs in the test process: a daemon with a disk tier, and an engine on it (issue 27).

The pool is small (RAM_BLOCKS), its slab several times larger, so a few
stores push blocks out of RAM onto the disk alone. `Engine` (a scheduler
and real worker processes) comes from the remote tier's tests.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvd_tools.launcher import DaemonProcess
from tests.integration.engine_harness import Rank
from tests.integration.remote_hosts import BLOCKS, SLOT_BYTES, TP, Host, stop_host

RAM_BLOCKS = 4 * BLOCKS  # the Engine's pool: 32 blocks
ROW_BYTES = SLOT_BYTES * TP
MAX_TOTAL = 64 << 20
# The pool's share of disk_bytes is disk_bytes * its RAM / max_total_bytes:
# 8x its RAM here (with the slab's header and entry table).
DISK_BYTES = 8 * MAX_TOTAL + (8 << 20)


def disk_flags(disk_dir: Path, **flags: str) -> dict[str, str]:
    return {
        "disk_dir": str(disk_dir),
        "disk_bytes": str(DISK_BYTES),
        "max_total_bytes": str(MAX_TOTAL),
        "disk_timeout_ms": "1000",
        **flags,
    }


def start_disk_host(disk_dir: Path, env: dict[str, str] | None = None, **flags: str) -> Host:
    d = DaemonProcess(env=env, **disk_flags(disk_dir, **flags)).start()
    return Host(d, [Rank(r, TP, d.endpoint) for r in range(TP)])


@contextlib.contextmanager
def disk_dir() -> Iterator[Path]:
    """A directory on a real disk (/tmp is ext4 on this machine and CI's), removed after."""
    with tempfile.TemporaryDirectory(prefix="kvd-disk-") as d:
        yield Path(d)


@contextlib.contextmanager
def disk_host(path: Path, **flags: str) -> Iterator[Host]:
    host = start_disk_host(path, **flags)
    try:
        yield host
    finally:
        stop_host(host)
