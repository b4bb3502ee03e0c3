"""Runs in the test process: the disk tier with a real daemon, files and worker processes (issue 27).

A pool of 32 blocks in RAM over a slab of 256: blocks stored by an engine
are written behind to the slab; once later stores pushed them out of RAM, a
lookup answers None while the daemon reads them back, then hits, and the
workers load the very bytes they stored. Restarts (SIGKILL, a reboot that
wiped /dev/shm) and damaged slabs are in test_disk_restart.py and
test_disk_faults.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.disk_hosts import RAM_BLOCKS, disk_dir, disk_host
from tests.integration.remote_hosts import BLOCKS, TP, Engine, Host, counters, fetch_all, wait_for


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    with disk_dir() as d, disk_host(d) as h:
        yield h


def keys_of(name: str, n: int = BLOCKS) -> list[bytes]:
    return [f"{name}/{i}".encode() for i in range(n)]


def push_out_of_ram(e: Engine, name: str) -> None:
    """Stores RAM_BLOCKS other blocks, BLOCKS at a time: the pool's LRU end goes."""
    for round_ in range(RAM_BLOCKS // BLOCKS):
        e.store(keys_of(f"{name}-filler-{round_}"), seed=100 + round_)


def test_a_block_pushed_out_of_ram_is_served_from_disk(host: Host) -> None:
    e = Engine(host, "evicted")
    try:
        keys = keys_of("evicted")
        stored = e.store(keys, seed=7)
        wait_for("the write-behind", lambda: counters(host.daemon).get(
            "disk.blocks_written", 0) >= BLOCKS)  # fmt: skip
        push_out_of_ram(e, "evicted")
        assert e.scheduler.lookup(keys) is None  # the daemon reads them from disk: retry
        seen = fetch_all(e.scheduler, keys)
        assert set(seen) <= {None, BLOCKS}
        loaded = e.load(keys)
        for rank in range(TP):
            assert loaded[rank] == stored[rank], f"rank {rank}: bytes differ"
        c = counters(host.daemon)
        assert c["disk.hits"] >= BLOCKS
        assert c.get("disk.bad_rows", 0) == 0 and c.get("disk.errors", 0) == 0
    finally:
        e.close()
