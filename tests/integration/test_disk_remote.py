"""Runs in the test process: the disk tier under the remote tier (issue 27), on a real Redis.

Host A stores blocks, which go to Redis. Host B, with a disk tier, fetches
them from Redis on a miss and writes them to its disk (never back to
Redis); once they left B's RAM, B serves them from its disk, not Redis.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvd_tools.launcher import DaemonProcess
from kvd_tools.redis_launcher import RedisServer
from tests.integration.disk_hosts import RAM_BLOCKS, disk_dir, disk_flags
from tests.integration.engine_harness import Rank
from tests.integration.remote_hosts import (
    BLOCKS,
    TIMEOUT_MS,
    TP,
    Engine,
    Host,
    counters,
    fetch_all,
    needs_redis,
    start_host,
    stop_host,
    wait_for,
)  # fmt: skip

pytestmark = needs_redis


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    store = RedisServer()
    store.start()
    a = b = None
    try:
        with disk_dir() as d:
            a = start_host(store.url, max_total_bytes="64MiB")
            flags = disk_flags(d, remote_url=store.url, remote_timeout_ms=str(TIMEOUT_MS))
            daemon = DaemonProcess(**flags).start()
            b = Host(daemon, [Rank(r, TP, daemon.endpoint) for r in range(TP)])
            yield a, b
    finally:
        for h in (a, b):
            if h is not None:
                stop_host(h)
        store.stop()


def test_blocks_from_the_remote_tier_go_to_disk_and_come_back_from_there(
    hosts: tuple[Host, Host],
) -> None:
    a, b = hosts
    keys = [f"via-redis/{i}".encode() for i in range(BLOCKS)]
    ea = Engine(a, "shared")
    try:
        stored = ea.store(keys, seed=21)
        wait_for("A's write-behind", lambda: counters(a.daemon).get(
            "remote.blocks_written", 0) >= BLOCKS)  # fmt: skip
    finally:
        ea.close()
    eb = Engine(b, "shared")
    try:
        fetch_all(eb.scheduler, keys)
        wait_for("B's disk write-behind", lambda: counters(b.daemon).get(
            "disk.blocks_written", 0) >= BLOCKS)  # fmt: skip
        c = counters(b.daemon)
        assert c["remote.hits"] >= BLOCKS
        assert c.get("remote.blocks_written", 0) == 0  # fetched blocks never go back
        for round_ in range(RAM_BLOCKS // BLOCKS):  # B's RAM lets them go
            eb.store([f"filler-{round_}/{i}".encode() for i in range(BLOCKS)], seed=30 + round_)
        remote_hits = counters(b.daemon)["remote.hits"]
        seen = fetch_all(eb.scheduler, keys)
        assert None in seen
        loaded = eb.load(keys)
        assert all(loaded[r] == stored[r] for r in range(TP))
        c = counters(b.daemon)
        assert c["disk.hits"] >= BLOCKS
        assert c["remote.hits"] == remote_hits  # from disk, not Redis
    finally:
        eb.close()
