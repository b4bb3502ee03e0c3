"""Runs in the test process: two kvd hosts on one remote tier, and engines on them (issue 17).

Two daemons in two runtime dirs stand for two hosts. An `Engine` is a
scheduler with real worker processes on one host's pool.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvd_client import Layout, Scheduler
from kvd_tools.launcher import DaemonProcess
from kvd_tools.redis_launcher import available
from tests.integration.engine_harness import CacheSpec, Rank, all_ranks

# The remote tier's tests run real redis-server processes.
needs_redis = pytest.mark.skipif(
    not available(), reason="redis-server is not installed (make test installs it as root)"
)
TP = 2
SLOT_BYTES = 64 << 10
BLOCKS = 8
TIMEOUT_MS = 400


def counters(d: DaemonProcess) -> dict[str, int]:
    with Scheduler("probe", Layout("probe", "bfloat16", 16, 1, False, 256),
                   engine_id="probe", endpoint=d.endpoint) as s:  # fmt: skip
        return dict(s.stats().counters)


def wait_for(what: str, check: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class Host:
    daemon: DaemonProcess
    ranks: list[Rank]


@dataclass
class Hosts:
    kind: str
    store: Any  # RedisServer or RedisClusterProcesses
    a: Host
    b: Host


def start_host(url: str, tp: int = TP, **flags: str) -> Host:
    flags = {"remote_timeout_ms": str(TIMEOUT_MS), "max_total_bytes": "1GiB", **flags}
    d = DaemonProcess(remote_url=url, **flags).start()
    return Host(d, [Rank(r, tp, d.endpoint) for r in range(tp)])


def stop_host(h: Host) -> None:
    for r in h.ranks:
        r.kill()
    h.daemon.stop()


@contextlib.contextmanager
def hosts_on(url: str, n: int, tp: int = TP, **flags: str) -> Iterator[list[Host]]:
    """`n` hosts on the remote tier at `url`, stopped (each one started) at the end."""
    hosts: list[Host] = []
    try:
        for _ in range(n):
            hosts.append(start_host(url, tp, **flags))
        yield hosts
    finally:
        for h in hosts:
            stop_host(h)


class Engine:
    """A scheduler and its worker ranks on one host's pool."""

    def __init__(self, host: Host, pool: str, replicated: bool = False, extra: str = "") -> None:
        self.host = host
        self.tp = tp = len(host.ranks)
        self.layout_args = (f"model-{pool}", "bfloat16", 16, tp, replicated, SLOT_BYTES, extra)
        self.layout = Layout(*self.layout_args)
        self.scheduler = Scheduler(
            pool, self.layout, engine_id=f"model-{pool}-engine", endpoint=host.daemon.endpoint,
            capacity_bytes=4 * BLOCKS * SLOT_BYTES * (1 if replicated else tp),
        )  # fmt: skip
        spec = CacheSpec("contiguous", SLOT_BYTES, 4 * BLOCKS)
        all_ranks(host.ranks, "open", (pool, self.layout_args, spec))

    def store(self, keys: list[bytes], seed: int) -> list[list[str]]:
        all_ranks(self.host.ranks, "fill", seed)
        src = list(range(len(keys)))
        digests = all_ranks(self.host.ranks, "digest", src)
        ticket = self.scheduler.store(keys, src)
        assert ticket is not None and ticket.job_id is not None
        assert (
            all_ranks(self.host.ranks, "wait", [ticket.job_id]) == [{ticket.job_id: True}] * self.tp
        )
        wait_for("the store", lambda: any(r.ok for r in self.scheduler.finished()))
        return list(digests)

    def load(self, keys: list[bytes]) -> list[list[str]]:
        all_ranks(self.host.ranks, "zero")
        dst = [2 * BLOCKS + i for i in reversed(range(len(keys)))]
        job = self.scheduler.load(keys, dst)
        assert all_ranks(self.host.ranks, "wait", [job]) == [{job: True}] * self.tp
        return list(all_ranks(self.host.ranks, "digest", dst))

    def close(self) -> None:
        self.scheduler.close()


def fetch_all(s: Scheduler, keys: list[bytes]) -> list[int | None]:
    """Lookups until every key hits; the answers seen on the way."""
    seen: list[int | None] = []

    def look() -> bool:
        hits = s.lookup(keys)
        if not seen or seen[-1] != hits:
            seen.append(hits)
        return hits == len(keys)

    wait_for("the remote blocks", look)
    return seen
