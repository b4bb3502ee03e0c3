"""Runs in the soak harness: what it reads about the daemon and its children.

The daemon's RSS comes from /proc (VmRSS); invariants and counters from one
short admin session per probe (a restarted daemon needs a fresh Hello); the
parent of a pid tells the engine's ranks from recycled pids before a SIGKILL.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.paths import read_admin_token, runtime_dir_of

PROBE_TIMEOUT_MS = 5000  # the daemon must answer an admin within this, under full load


def rss_mb(pid: int) -> float:
    """VmRSS of process `pid` in MiB (0 when it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def parent_of(pid: int) -> int:
    """The parent pid of `pid`; -1 when it is gone (or a zombie: it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return -1 if state in ("Z", "X") else int(ppid)


def is_spawned_child(pid: int) -> bool:
    """Whether `pid` is a multiprocessing child (so not a recycled pid of someone else's)."""
    try:
        return b"multiprocessing" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _admin(endpoint: str) -> Connection:
    conn = Connection(endpoint, role="admin", keeper=False, timeout_ms=PROBE_TIMEOUT_MS)
    conn.connect()
    return conn


def invariant_problems(endpoint: str) -> list[str]:
    """The SPEC section 4 invariants that fail on any pool; `KvdError` if no answer."""
    conn = _admin(endpoint)
    try:
        runtime = runtime_dir_of(endpoint)  # the operator token: the soak owns its daemon
        reply = conn.call(p.CheckInvariants, read_admin_token(runtime) if runtime else "")
        assert isinstance(reply, p.InvariantsResult)
        return reply.problems
    finally:
        conn.close()


def daemon_stats(endpoint: str) -> p.StatsResult:
    """The daemon's Stats; `KvdError` if no answer."""
    conn = _admin(endpoint)
    try:
        reply = conn.call(p.Stats)
        assert isinstance(reply, p.StatsResult)
        return reply
    finally:
        conn.close()


def drained(stats: p.StatsResult) -> bool:
    """No session but the probe's, no job, nothing pinned or in flight in any pool."""
    return (
        stats.sessions <= 1
        and stats.jobs_in_flight == 0
        and all(pi.blocks_pinned == 0 and pi.blocks_in_flight == 0 for pi in stats.pools)
    )
