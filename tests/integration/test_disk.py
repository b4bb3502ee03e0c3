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
from pathlib import Path

import pytest

from tests.integration.disk_hosts import RAM_BLOCKS, ROW_BYTES, disk_dir, disk_host
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
        assert c["bytes_loaded"] >= BLOCKS * ROW_BYTES  # what kvd_transfer_bytes{load} shows
    finally:
        e.close()


def test_blocks_on_disk_are_announced_as_storage_local(host: Host) -> None:
    from tests.integration.test_remote import replayed_events

    e = Engine(host, "announced")
    try:
        keys = keys_of("announced")
        e.store(keys, seed=5)
        wait_for("the write-behind", lambda: any(
            pi.name == "announced" and pi.disk_blocks >= BLOCKS
            for pi in e.scheduler.stats().pools))  # fmt: skip
        events = [ev for ev in replayed_events(host.daemon) if ev.get("type") == "BlockStored"]
        on_disk = {h for ev in events if ev.get("medium") == "STORAGE"
                   and ev.get("locality") == "LOCAL" for h in ev["block_hashes"]}  # fmt: skip
        in_ram = {h for ev in events if ev.get("medium") == "CPU" for h in ev["block_hashes"]}
        assert set(keys) <= on_disk and set(keys) <= in_ram
    finally:
        e.close()


def test_a_reset_empties_the_disk_and_a_drop_deletes_the_slab(host: Host) -> None:
    import subprocess
    import sys

    e = Engine(host, "emptied")
    try:
        keys = keys_of("emptied")
        e.store(keys, seed=9)
        wait_for("the write-behind", lambda: disk_blocks(e, "emptied") >= BLOCKS)
        e.scheduler.reset()
        wait_for("the reset", lambda: disk_blocks(e, "emptied") == 0)
        wait_for("no hit anywhere", lambda: e.scheduler.lookup(keys) == 0)
    finally:
        e.close()
    slab = Path(host.daemon.flags["disk-dir"]) / "emptied.slab"
    assert slab.exists() and slab.with_suffix(".entries").exists()
    out = subprocess.run([sys.executable, "-m", "kvd", "pool", "drop", "emptied",
                          "--runtime-dir", str(host.daemon.runtime_dir)],
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not slab.exists() and not slab.with_suffix(".entries").exists()


def disk_blocks(e: Engine, pool: str) -> int:
    return next(pi.disk_blocks for pi in e.scheduler.stats().pools if pi.name == pool)


def test_with_disk_admit_second_a_block_goes_to_disk_at_its_second_store() -> None:
    with disk_dir() as d, disk_host(d, disk_admit="second") as h:
        e = Engine(h, "twice")
        try:
            keys = keys_of("twice")
            e.store(keys, seed=3)
            wait_for("the first store seen", lambda: counters(h.daemon).get(
                "disk.writes_deferred", 0) >= BLOCKS)  # fmt: skip
            assert disk_blocks(e, "twice") == 0
            push_out_of_ram(e, "twice")
            wait_for("out of RAM", lambda: e.scheduler.lookup(keys) == 0)
            stored = e.store(keys, seed=3)
            wait_for("the second store written", lambda: disk_blocks(e, "twice") >= BLOCKS)
            push_out_of_ram(e, "twice-again")
            seen = fetch_all(e.scheduler, keys)
            assert None in seen  # read back from disk
            assert e.load(keys) == stored
        finally:
            e.close()


def test_the_indexes_hold_their_invariants_after_all_this(host: Host) -> None:
    """Runs last in this module: the RAM and disk indexes of every pool above."""
    e = Engine(host, "evicted")
    try:
        assert e.scheduler.check_invariants(host.daemon.admin_token) == []
        assert any(pi.disk_blocks for pi in e.scheduler.stats().pools)
    finally:
        e.close()
