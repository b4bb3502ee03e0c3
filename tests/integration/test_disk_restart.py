"""Runs in the test process: the disk tier across daemon restarts, byte for byte (issue 27, SPEC 13 and 16).

A real daemon with a disk tier in a directory of /tmp (ext4), an Engine (a
scheduler and two real worker processes) on a pool of 32 blocks over a slab
of 259 rows. Each test stores a set of blocks, waits until the write-behind
put them on disk, pushes them out of RAM with 32 other blocks, then stops
the daemon one way or another and starts it again in the same runtime dir
and disk_dir:

- SIGKILL, segments still there: the pool and its slab are both adopted;
  the blocks only the disk held come back from disk, the bytes the workers
  load are those they stored.
- a reboot (SIGKILL, every /dev/shm segment of the runtime dir unlinked,
  the workers gone too): the RAM pool starts empty, the slab is adopted
  with its 40 blocks (one log line says so) and serves them.
- `restart = "cold"`: the slab is not adopted but made again, empty (a new
  slab id, no entry), and a cold daemon's shutdown deletes it.
- a second daemon on the same disk_dir and pool name: `flock` refuses it
  the slab, its pool runs without a disk tier (one log line says why), and
  the first daemon's slab stays whole and keeps serving.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import posix_ipc
import pytest

from kvd_client import Scheduler
from kvd_tools.launcher import DaemonProcess
from tests.integration.disk_cases import (
    delta,
    disk_entries,
    events,
    fillers_in_ram,
    keys_of,
    pool_events,
    pool_info,
    push_out_of_ram,
    read_back,
    stats,
    store_on_disk,
    wait_clients_back,
)
from tests.integration.disk_hosts import disk_dir, disk_flags, start_disk_host
from tests.integration.engine_harness import Rank
from tests.integration.remote_hosts import BLOCKS, TP, Engine, Host, stop_host, wait_for

ON_DISK = BLOCKS + 4 * BLOCKS  # the blocks stored, then the fillers: all written to disk


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[Host, Path]]:
    """A daemon the tests that leave it running share, each on its own pool."""
    with disk_dir() as where:
        h = start_disk_host(where)
        try:
            yield h, where
        finally:
            stop_host(h)


@pytest.fixture
def where() -> Iterator[Path]:
    with disk_dir() as d:
        yield d


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    """Hosts a test starts, each stopped (its workers and its daemon) at the end."""
    started: list[Host] = []
    yield started
    for h in started:
        stop_host(h)


def pushed_out(h: Host, pool: str) -> tuple[Engine, list[bytes], list[list[str]]]:
    """`stored_then_pushed_out` without reading the blocks back: only the disk holds them."""
    e = Engine(h, pool)
    keys = keys_of(pool)
    stored = store_on_disk(e, keys, seed=7)
    push_out_of_ram(e, pool)
    return e, keys, stored


def adopted_lines(d: DaemonProcess, pool: str) -> list[str]:
    return pool_events(d, "disk_slab_adopted", pool)


def created_lines(d: DaemonProcess, pool: str) -> list[str]:
    return pool_events(d, "disk_slab_created", pool)


def test_after_sigkill_the_blocks_only_on_disk_come_back_from_disk(
    shared: tuple[Host, Path],
) -> None:
    h, where = shared
    d = h.daemon
    e, keys, stored = pushed_out(h, "killed")
    try:
        on_disk = disk_entries(where, "killed")
        assert set(keys) <= set(on_disk.rows) and len(on_disk.rows) == ON_DISK
        segments = [s for s in d.segments() if s.startswith("/kvd.killed.")]
        assert segments
        epoch = e.scheduler.epoch
        d.kill(signal.SIGKILL)
        assert all(os.path.exists("/dev/shm" + s) for s in segments)  # no reboot here
        d.start()
        wait_clients_back(e, epoch)
        # The RAM pool came back from its segment, the slab from its files.
        assert pool_events(d, "pool_adopted", "killed")
        lines = pool_events(d, "disk_slab_adopted", "killed")
        assert len(lines) == 1 and f" blocks={ON_DISK} " in lines[0], lines
        before = stats(d)
        assert e.scheduler.lookup(fillers_in_ram("killed")) == BLOCKS  # RAM's own, at once
        seen = read_back(e, keys, stored)  # bytes equal on every rank
        assert seen[0] is None, f"answered {seen} before reading the disk"
        after = stats(d)
        assert delta(after, before, "disk.hits") == BLOCKS
        assert delta(after, before, "disk.bad_rows") == delta(after, before, "disk.errors") == 0
        assert disk_entries(where, "killed").slab_id == on_disk.slab_id  # the same slab
    finally:
        e.close()


def test_after_a_reboot_the_ram_pool_starts_empty_and_the_disk_serves(
    hosts: list[Host], where: Path
) -> None:
    h = start_disk_host(where)
    hosts.append(h)
    d = h.daemon
    e, keys, stored = pushed_out(h, "rebooted")
    slab_id = disk_entries(where, "rebooted").slab_id
    e.close()
    # A reboot: the daemon and the engine's processes die, /dev/shm is wiped.
    d.kill(signal.SIGKILL)
    for r in h.ranks:
        r.kill()
    segments = d.segments()
    assert any(s.startswith("/kvd.rebooted.") for s in segments), segments
    for name in segments:
        posix_ipc.unlink_shared_memory(name)
    assert not any(os.path.exists("/dev/shm" + s) for s in segments)
    d.start()
    h.ranks[:] = [Rank(r, TP, d.endpoint) for r in range(TP)]
    assert pool_info(d, "rebooted") is None  # nothing of the pool in RAM
    assert not adopted_lines(d, "rebooted")  # the slab is adopted with its pool
    e = Engine(h, "rebooted")
    try:
        info = pool_info(d, "rebooted")
        assert info is not None and info.blocks_ready == 0  # the RAM pool starts empty
        lines = adopted_lines(d, "rebooted")
        assert len(lines) == 1 and f" blocks={ON_DISK} " in lines[0], lines
        assert not [line for line in events(d, "disk_slab_not_adopted") if "rebooted" in line]
        seen = read_back(e, keys, stored)
        assert seen[0] is None, seen
        # The fillers too, which RAM held before the reboot: from disk now.
        fillers = fillers_in_ram("rebooted")
        assert e.scheduler.lookup(fillers) is None
        wait_for("the fillers from disk", lambda: e.scheduler.lookup(fillers) == BLOCKS)
        c = stats(d)
        assert c["disk.hits"] == 2 * BLOCKS
        assert c.get("disk.bad_rows", 0) == 0 and c.get("disk.errors", 0) == 0
        assert disk_entries(where, "rebooted").slab_id == slab_id
    finally:
        e.close()


def test_restart_cold_makes_the_slab_again_empty_and_its_shutdown_deletes_it(
    hosts: list[Host], where: Path
) -> None:
    """`restart = "cold"` (docs/disk-tier.md: "starts with empty slabs and deletes
    them at shutdown"): a cold start does not adopt a slab, it makes it again,
    empty, in the same files (a new slab id, no entry; no
    disk_slab_not_adopted line, a disk_slab_created one); a cold shutdown
    deletes both files, as it unlinks the pools' segments."""
    h = start_disk_host(where)
    hosts.append(h)
    d = h.daemon
    e, keys, _ = pushed_out(h, "cold")
    slab_id = disk_entries(where, "cold").slab_id
    e.close()
    created_before = len(created_lines(d, "cold"))
    d.kill(signal.SIGKILL)
    d.flags["restart"] = "cold"
    d.start()
    e = Engine(h, "cold")
    try:
        assert e.scheduler.lookup(keys) == 0  # neither RAM nor disk holds them
        assert e.scheduler.lookup(fillers_in_ram("cold")) == 0
        assert not adopted_lines(d, "cold")
        assert not events(d, "disk_slab_not_adopted")
        created = created_lines(d, "cold")
        assert created_before == 1 and len(created) == 2, created  # the first run's, this one's
        entries = disk_entries(where, "cold")
        assert entries.slab_id != slab_id and entries.rows == {}
        c = stats(d)
        assert c.get("disk.hits", 0) == 0 and c["disk.misses"] >= 1
        wait_for("the disk gauges", lambda: stats(d).get("disk.capacity_bytes", 0) > 0)
        assert stats(d).get("disk.blocks", 0) == 0
    finally:
        e.close()
    assert d.kill(signal.SIGTERM) == 0
    assert not (where / "cold.slab").exists() and not (where / "cold.entries").exists()


def test_a_second_daemon_on_the_same_slab_runs_without_a_disk_tier(
    shared: tuple[Host, Path],
) -> None:
    a, where = shared
    e, keys, stored = pushed_out(a, "shared")
    slab = where / "shared.slab"
    size, slab_id = slab.stat().st_size, disk_entries(where, "shared").slab_id
    b = DaemonProcess(**disk_flags(where))
    try:
        b.start()
        with Scheduler("shared", e.layout, engine_id="second", endpoint=b.endpoint,
                       capacity_bytes=4 * BLOCKS * e.layout.slot_bytes * TP) as s:  # fmt: skip
            lines = [line for line in events(b, "disk_tier_off") if " pool=shared " in line]
            assert len(lines) == 1, lines
            assert "in use by another kvd daemon" in lines[0], lines[0]
            wait_for("the gauges", lambda: stats(b).get("disk.slabs_failed") == 1)
            # Its pool works, in RAM alone.
            mine = keys_of("second")
            out = s.prepare_store(mine)
            assert out is not None and len(out.keys_to_store) == BLOCKS
            s.complete_store(mine)
            assert s.lookup(mine) == BLOCKS
            assert s.lookup(keys) == 0  # the first daemon's blocks are not its own
            c = stats(b)
            assert c.get("disk.blocks_written", 0) == 0 and c.get("disk.hits", 0) == 0
        # The first daemon's slab is as it was, and serves.
        assert slab.stat().st_size == size
        assert disk_entries(where, "shared").slab_id == slab_id
        before = stats(a.daemon)
        seen = read_back(e, keys, stored)
        assert seen[0] is None, seen
        after = stats(a.daemon)
        assert delta(after, before, "disk.hits") == BLOCKS
        assert delta(after, before, "disk.bad_rows") == 0
        assert not events(a.daemon, "disk_tier_off")
    finally:
        b.stop()
        e.close()
