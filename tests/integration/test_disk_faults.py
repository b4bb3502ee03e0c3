"""Runs in the test process: the disk tier's faults end as misses and counters (issue 27, SPEC 16).

Real daemons with a disk tier in /tmp (ext4), real worker processes, real
files. What no device here can do (EIO, a short read, a stalled disk) comes
from the I/O layer's fault seam, `KVD_DISK_FAULTS`, set on a daemon
restarted over a slab a healthy one wrote; everything else is done to the
files themselves: a byte flipped in a row, the slab truncated (stopped, and
under the running daemon), the files deleted under the running daemon, a
filesystem too small for the slab (a tmpfs of 8 MiB, as root). Each ends
as misses and counters, never as wrong bytes and never as a loop that stops
answering: the bytes the workers load are always those they stored, and
other requests are answered meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvd_client import Layout, Scheduler
from kvd_tools.launcher import DaemonProcess
from tests.integration.disk_cases import (
    DISK_ROW_BYTES,
    delta,
    disk_entries,
    events,
    fillers_in_ram,
    keys_of,
    lookups_until_settled,
    pool_events,
    push_out_of_ram,
    read_back,
    row_offset,
    stats,
    store_on_disk,
    wait_clients_back,
)
from tests.integration.disk_hosts import (
    DISK_BYTES,
    RAM_BLOCKS,
    disk_dir,
    disk_flags,
    disk_host,
    start_disk_host,
)
from tests.integration.remote_hosts import BLOCKS, Engine, Host, stop_host, wait_for

TIMEOUT_S = 1.0  # disk_flags' disk_timeout_ms
TICK_S = 0.5  # the daemon's tick, which gives fetches up
# An answer from a loop that is not waiting on the disk (reads take 5 s); wide,
# since other jobs share this machine's 2 cores.
QUICK_S = 1.5
SMALL = Layout("small", "bfloat16", 16, 1, False, 4096)


def timed(call: object) -> tuple[object, float]:
    start = time.monotonic()
    value = call()  # type: ignore[operator]
    return value, time.monotonic() - start


def small_pool(d: DaemonProcess, name: str) -> tuple[Scheduler, list[bytes]]:
    """A second pool, stored to by a scheduler alone (no bytes): its lookups
    hit RAM, so they answer whatever the disk does."""
    s = Scheduler(name, SMALL, engine_id=f"{name}-engine", endpoint=d.endpoint,
                  capacity_bytes=64 * 4096)  # fmt: skip
    keys = keys_of(name, 4)
    out = s.prepare_store(keys)
    assert out is not None and len(out.keys_to_store) == len(keys)
    s.complete_store(keys)
    assert s.lookup(keys) == len(keys)
    return s, keys


# -- read faults, on a daemon restarted over a slab a healthy one wrote ----------------


@dataclass
class Written:
    where: Path
    host: Host
    engine: Engine
    stored: dict[str, list[list[str]]]  # set name -> digests each rank stored
    fillers: list[list[str]]  # the digests of fillers_in_ram("faulty")

    @property
    def daemon(self) -> DaemonProcess:
        return self.host.daemon

    def restart(self, faults: str = "") -> None:
        """SIGKILL, and the daemon again in the same runtime dir and disk_dir,
        with `faults` in KVD_DISK_FAULTS ("" = none); the engine reconnects."""
        d, epoch = self.daemon, self.engine.scheduler.epoch
        d.kill(signal.SIGKILL)
        d.env = {"KVD_DISK_FAULTS": faults} if faults else None
        d.start()
        wait_clients_back(self.engine, epoch)
        adopted = [line for line in events(d, "disk_slab_adopted") if " pool=faulty " in line]
        assert adopted, "the slab the healthy daemon wrote was not adopted"


SETS = {"eio": 11, "short": 12, "slow": 13}  # a set of blocks per read fault, and its seed


@pytest.fixture(scope="module")
def written() -> Iterator[Written]:
    """Pool "faulty": a set of BLOCKS blocks per read fault, then RAM_BLOCKS
    fillers: every set is on disk alone, the last fillers in RAM."""
    with disk_dir() as where:
        h = start_disk_host(where)
        try:
            e = Engine(h, "faulty")
            try:
                stored = {
                    name: store_on_disk(e, keys_of(name), seed) for name, seed in SETS.items()
                }
                fillers = push_out_of_ram(e, "faulty")
                yield Written(where, h, e, stored, fillers)
            finally:
                e.close()
        finally:
            stop_host(h)


def read_fault(w: Written, name: str, faults: str) -> tuple[dict[str, int], dict[str, int]]:
    """The daemon restarted with `faults`; a lookup of the RAM fillers, then the
    set `name` (on disk alone): None while the disk is read, then the RAM hits
    alone. The counters before and after."""
    w.restart(faults)
    d, e = w.daemon, w.engine
    assert events(d, "disk_faults_injected"), "the fault seam is not on"
    on_disk = disk_entries(w.where, "faulty").rows
    assert set(keys_of(name)) <= set(on_disk)
    before = stats(d)
    fillers = fillers_in_ram("faulty")
    seen = lookups_until_settled(e, fillers + keys_of(name))
    assert seen == [None, BLOCKS], f"answers {seen}: want None while reading, then RAM's {BLOCKS}"
    assert e.scheduler.lookup(keys_of(name)) == 0  # a miss now, without a disk read
    after = stats(d)
    assert delta(after, before, "disk.hits") == 0
    assert delta(after, before, "disk.bytes_read") in (0, BLOCKS * DISK_ROW_BYTES // 2)
    assert delta(after, before, "disk.fetch_failures") == BLOCKS
    assert delta(after, before, "disk.rows_dropped") == BLOCKS  # not asked for again
    assert delta(after, before, "disk.misses") >= 1
    left = disk_entries(w.where, "faulty").rows
    assert not set(keys_of(name)) & set(left), "the rows that failed are still in the table"
    assert len(left) == len(on_disk) - BLOCKS  # the other sets stay
    read_back(e, fillers, w.fillers)  # RAM serves its own bytes
    return before, after


def test_eio_on_reads_ends_as_misses_counted(written: Written) -> None:
    before, after = read_fault(written, "eio", "read_eio")
    assert delta(after, before, "disk.errors") == BLOCKS
    assert delta(after, before, "disk.bad_rows") == 0
    assert delta(after, before, "disk.bytes_read") == 0  # nothing came off the disk
    assert events(written.daemon, "disk_read_failed")


def test_short_reads_end_as_misses_counted(written: Written) -> None:
    before, after = read_fault(written, "short", "read_short")
    assert delta(after, before, "disk.bad_rows") == BLOCKS
    assert delta(after, before, "disk.errors") == 0
    assert events(written.daemon, "disk_row_short")


def test_a_stalled_disk_is_given_up_in_time_and_the_loop_answers_meanwhile(
    written: Written,
) -> None:
    """Reads take 5 s, disk_timeout_ms is 1 s: the lookup answers None for about
    a timeout and a tick, then the RAM hits, and lookups stay answered (none
    waits on the stalled rows again while they are read); stats and another
    pool's lookups are answered at once throughout. Healthy again, the daemon
    serves the blocks with their bytes."""
    w = written
    w.restart("read_slow_ms=5000")
    d, e = w.daemon, w.engine
    other, other_keys = small_pool(d, "bystander")
    try:
        keys = fillers_in_ram("faulty") + keys_of("slow")
        before = stats(d)
        start = time.monotonic()
        assert e.scheduler.lookup(keys) is None  # the disk read starts
        slowest = 0.0
        answers: list[int | None] = []
        while time.monotonic() - start < TIMEOUT_S + TICK_S + 2.0:
            hits, took = timed(lambda: e.scheduler.lookup(keys))
            _, took_stats = timed(lambda: stats(d))
            theirs, took_other = timed(lambda: other.lookup(other_keys))
            assert theirs == len(other_keys)
            slowest = max(slowest, took, took_stats, took_other)
            if not answers or answers[-1] != hits:
                answers.append(hits)
            if hits is not None:
                break
            time.sleep(0.02)
        waited = time.monotonic() - start
        assert answers == [None, BLOCKS], f"answers {answers} within {waited:.2f} s"
        assert TIMEOUT_S - 0.1 <= waited <= TIMEOUT_S + TICK_S + 1.5, f"None for {waited:.2f} s"
        assert slowest < QUICK_S, f"a request took {slowest:.2f} s while the disk stalled"
        # The rows are still being read (5 s): no lookup waits on them again.
        for _ in range(10):
            assert e.scheduler.lookup(keys) == BLOCKS
            time.sleep(0.05)
        after = stats(d)
        assert delta(after, before, "disk.timeouts") >= 1
        assert delta(after, before, "disk.hits") == 0
        assert delta(after, before, "disk.fetch_failures") == BLOCKS
        assert events(d, "disk_fetch_timeout")
    finally:
        other.close()
    # Healthy again: the rows a stalled read gave up are still on disk, whole.
    assert set(keys_of("slow")) <= set(disk_entries(w.where, "faulty").rows)
    w.restart()
    read_back(e, keys_of("slow"), w.stored["slow"])
    c = stats(d)
    assert c["disk.hits"] == BLOCKS and c.get("disk.bad_rows", 0) == 0


# -- write faults ----------------------------------------------------------------------


def test_eio_on_writes_is_counted_and_ram_keeps_serving() -> None:
    with disk_dir() as where:
        h = start_disk_host(where, env={"KVD_DISK_FAULTS": "write_eio"})
        try:
            d = h.daemon
            e = Engine(h, "wfail")
            try:
                keys = keys_of("wfail")
                stored = e.store(keys, seed=7)
                wait_for("the failed writes", lambda: stats(d).get("disk.writes_failed") == BLOCKS)
                read_back(e, keys, stored)  # from RAM
                for round_ in range(RAM_BLOCKS // BLOCKS):  # pushed out of RAM
                    e.store(keys_of(f"wfail-filler-{round_}"), seed=100 + round_)
                    done = BLOCKS * (round_ + 2)
                    wait_for("the failed writes",
                             lambda n=done: stats(d).get("disk.writes_failed") == n)  # fmt: skip
                assert e.scheduler.lookup(keys) == 0  # a miss: the disk has nothing
                wait_for("a tick", lambda: stats(d).get("disk.capacity_bytes", 0) > 0)
                time.sleep(TICK_S + 0.1)  # the gauges after the last write
                c = stats(d)
                assert c.get("disk.blocks_written", 0) == 0 and c.get("disk.blocks", 0) == 0
                assert c.get("disk.bytes_used", 0) == 0
                assert c["disk.errors"] == c["disk.writes_failed"] == BLOCKS + RAM_BLOCKS
                assert c.get("disk.fetches", 0) == 0 and c.get("disk.hits", 0) == 0
                assert c["disk.misses"] >= 1
                assert disk_entries(where, "wfail").rows == {}
                assert events(d, "disk_write_failed")
            finally:
                e.close()
        finally:
            stop_host(h)


def test_a_reset_finishes_while_the_disk_stalls_its_writes() -> None:
    """Writes take 10 s: the write-behind holds the RAM rows it copies from, and
    a Reset waits for every holder. The reset lets go of them at once, so it
    finishes in a tick, the pool serves stores again, and no block of before
    the reset comes back (from RAM or, once the writes land, from disk)."""
    with disk_dir() as where:
        h = start_disk_host(where, env={"KVD_DISK_FAULTS": "write_slow_ms=10000"})
        try:
            d = h.daemon
            e = Engine(h, "wstall")
            try:
                keys = keys_of("wstall")
                e.store(keys, seed=5)
                wait_for("the writes under way",
                         lambda: stats(d).get("disk.write_bytes_in_flight", 0) > 0)  # fmt: skip
                start = time.monotonic()
                e.scheduler.reset()
                wait_for("the reset", lambda: e.scheduler.lookup(keys) == 0, timeout=5.0)
                took = time.monotonic() - start
                assert took < TICK_S + QUICK_S, f"the reset took {took:.2f} s"
                after = keys_of("wstall-after")
                stored = e.store(after, seed=6)  # the pool stores again
                read_back(e, after, stored)
                assert e.scheduler.lookup(keys) == 0
            finally:
                e.close()
        finally:
            stop_host(h)


# -- the files themselves: a flipped byte, a truncated or deleted slab -----------------


@pytest.fixture(scope="module")
def healthy() -> Iterator[tuple[Host, Path]]:
    """A healthy daemon shared by tests that each damage their own pool's slab."""
    with disk_dir() as where, disk_host(where) as h:
        yield h, where


def on_disk_alone(h: Host, pool: str) -> tuple[Engine, list[bytes], list[list[str]]]:
    """An Engine on `pool`; BLOCKS blocks stored, written to disk, pushed out of RAM."""
    e = Engine(h, pool)
    try:
        keys = keys_of(pool)
        stored = store_on_disk(e, keys, seed=7)
        push_out_of_ram(e, pool)
    except BaseException:
        e.close()
        raise
    return e, keys, stored


def test_a_flipped_byte_in_a_row_is_a_miss_and_the_row_leaves_the_index(
    healthy: tuple[Host, Path],
) -> None:
    h, where = healthy
    d = h.daemon
    e, keys, stored = on_disk_alone(h, "flip")
    try:
        rows = disk_entries(where, "flip").rows
        victim = 3
        at = row_offset(rows[keys[victim]]) + DISK_ROW_BYTES // 3
        fd = os.open(where / "flip.slab", os.O_RDWR)
        try:
            old = os.pread(fd, 4096, at - at % 4096)
            assert old.strip(b"\0"), "the row holds no data where the byte is flipped"
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0x5A]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
        before = stats(d)
        seen = lookups_until_settled(e, keys)
        # The rows before the damaged one are read and ready; it is a miss.
        assert seen == [None, victim], seen
        after = stats(d)
        assert delta(after, before, "disk.bad_rows") == 1
        assert delta(after, before, "disk.rows_dropped") == 1
        assert delta(after, before, "disk.hits") == BLOCKS - 1
        assert delta(after, before, "disk.errors") == 0
        assert keys[victim] not in disk_entries(where, "flip").rows
        assert e.scheduler.lookup(keys[victim:]) == 0  # not on disk any more: no read
        assert [line for line in events(d, "disk_row_refused") if "reason=checksum" in line]
        # The others, with their bytes.
        read_back(e, keys[:victim], [r[:victim] for r in stored])
        read_back(e, keys[victim + 1 :], [r[victim + 1 :] for r in stored])
    finally:
        e.close()


def test_a_slab_truncated_under_the_daemon_reads_short_misses_counted(
    healthy: tuple[Host, Path],
) -> None:
    h, where = healthy
    d = h.daemon
    e, keys, _ = on_disk_alone(h, "cut")
    other, other_keys = small_pool(d, "cut-bystander")
    try:
        os.truncate(where / "cut.slab", 4096)  # the header alone: every row past the end
        fillers = fillers_in_ram("cut")
        before = stats(d)
        seen = lookups_until_settled(e, fillers + keys)
        assert seen == [None, BLOCKS], seen  # then the RAM hits alone
        assert other.lookup(other_keys) == len(other_keys)
        after = stats(d)
        assert delta(after, before, "disk.bad_rows") == BLOCKS
        assert delta(after, before, "disk.rows_dropped") == BLOCKS
        assert delta(after, before, "disk.hits") == 0
        assert e.scheduler.lookup(keys) == 0
        assert [line for line in events(d, "disk_row_short") if " pool=cut " in line]
    finally:
        other.close()
        e.close()


def restart(h: Host, sig: int = signal.SIGKILL) -> None:
    """The shared daemon stopped with `sig` and started again (same dirs)."""
    h.daemon.kill(sig)
    h.daemon.start()


def test_a_slab_truncated_while_stopped_is_refused_with_one_line_and_starts_empty(
    healthy: tuple[Host, Path],
) -> None:
    h, where = healthy
    d = h.daemon
    e, keys, _ = on_disk_alone(h, "trunc")
    e.close()
    d.kill(signal.SIGTERM)  # warm: the pool's segment and its slab are kept
    slab = where / "trunc.slab"
    os.truncate(slab, slab.stat().st_size - DISK_ROW_BYTES)
    d.start()  # the pool's segment is adopted at start, and its slab with it
    lines = pool_events(d, "disk_slab_not_adopted", "trunc")
    assert len(lines) == 1, lines
    assert "reason=slab truncated" in lines[0], lines[0]
    assert len(pool_events(d, "disk_slab_created", "trunc")) == 2  # made, made again
    assert not pool_events(d, "disk_slab_adopted", "trunc")
    assert disk_entries(where, "trunc").rows == {}
    assert slab.stat().st_size > 0 and (where / "trunc.entries").exists()  # whole again
    e = Engine(h, "trunc")
    try:
        before = stats(d)
        assert e.scheduler.lookup(keys) == 0  # pushed out of RAM, and the disk is empty
        after = stats(d)
        assert delta(after, before, "disk.fetches") == 0
        assert delta(after, before, "disk.misses") == 1
    finally:
        e.close()


SLAB_EVENTS = ("disk_slab_created", "disk_slab_adopted", "disk_slab_not_adopted")


def test_a_slab_deleted_under_the_daemon_keeps_serving_then_starts_anew(
    healthy: tuple[Host, Path],
) -> None:
    """Unlinked while the daemon runs: its open descriptors still read and write
    the rows. At the next start the files are gone: a new empty slab, one
    line (disk_slab_created: nothing says what was there). With the entry
    table left and the .slab alone deleted, the line says the slab is missing."""
    h, where = healthy
    d = h.daemon
    e, keys, stored = on_disk_alone(h, "gone")
    try:
        for name in ("gone.slab", "gone.entries"):
            (where / name).unlink()
        before = stats(d)
        seen = read_back(e, keys, stored)  # from the deleted files
        assert seen[0] is None, seen
        more = keys_of("gone-more")
        store_on_disk(e, more, seed=9)  # and written to them
        after = stats(d)
        assert delta(after, before, "disk.hits") == BLOCKS
        assert delta(after, before, "disk.errors") == 0
        assert delta(after, before, "disk.bad_rows") == 0
    finally:
        e.close()
    lines_before = {event: len(pool_events(d, event, "gone")) for event in SLAB_EVENTS}
    restart(h)
    new = {event: len(pool_events(d, event, "gone")) - n for event, n in lines_before.items()}
    assert new == {"disk_slab_created": 1, "disk_slab_adopted": 0,
                   "disk_slab_not_adopted": 0}, new  # fmt: skip
    assert disk_entries(where, "gone").rows == {}
    e = Engine(h, "gone")
    try:
        # Out of RAM since, and on the deleted slab alone: a miss now.
        assert e.scheduler.lookup(keys_of("gone-filler-0")) == 0
    finally:
        e.close()
    # Now the .slab alone goes; its entry table stays.
    (where / "gone.slab").unlink()
    restart(h)
    lines = pool_events(d, "disk_slab_not_adopted", "gone")
    assert len(lines) == 1 and "reason=its slab is missing" in lines[0], lines
    assert (where / "gone.slab").exists() and disk_entries(where, "gone").rows == {}


# -- a filesystem too small for the slab -----------------------------------------------


@contextlib.contextmanager
def small_tmpfs() -> Iterator[Path]:
    """A tmpfs of 8 MiB (root only; skips when it cannot be mounted here)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (ENOSPC at slab creation) takes root")
    where = Path(tempfile.mkdtemp(prefix="kvd-enospc-"))
    try:
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)  # fmt: skip
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
        try:
            yield where
        finally:
            subprocess.run(["umount", str(where)], check=True)
    finally:
        os.rmdir(where)


def test_enospc_at_slab_creation_leaves_the_pool_without_a_disk_tier() -> None:
    with small_tmpfs() as where:
        assert DISK_BYTES > 8 << 20
        d = DaemonProcess(**disk_flags(where)).start()
        try:
            capacity = 4 << 20  # its share of disk_bytes: 8x that, on 8 MiB
            with Scheduler("full", SMALL, engine_id="full-engine", endpoint=d.endpoint,
                           capacity_bytes=capacity) as s:  # fmt: skip
                lines = [line for line in events(d, "disk_tier_off") if " pool=full " in line]
                assert len(lines) == 1, lines
                assert "No space left on device" in lines[0], lines[0]
                wait_for("the gauges", lambda: stats(d).get("disk.slabs_failed") == 1)
                assert os.listdir(where) == [], "a partial slab was left"
                keys = keys_of("full")
                out = s.prepare_store(keys)
                assert out is not None and len(out.keys_to_store) == BLOCKS
                s.complete_store(keys)
                assert s.lookup(keys) == BLOCKS  # the pool works, in RAM
                c = stats(d)
                assert c.get("disk.blocks_written", 0) == 0 and c.get("disk.capacity_bytes") == 0
        finally:
            d.stop()
