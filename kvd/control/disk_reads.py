"""Runs in the daemon: the disk tier's reads, on the event loop (SPEC 16).

A `Lookup` whose leading RAM hits end at a miss comes here
(`DiskReads.lookup`) before the remote tier:

    the disk index's leading run of ready keys from the miss on (at most
    MAX_FETCH_BYTES and a quarter of the pool) gets fresh RAM slots
    (`prepare_store` under the fetch's own owner: not ready, so lookups
    answer None meanwhile) and its disk rows are pinned (not rewritten while
    read); each row goes to an I/O thread, which reads it into its staging
    buffer and, while the fetch stands, copies it into its slot computing
    its CRC-32C (key, then row) on the way; the loop makes the rows whose
    checksum matched ready (blocks read from disk are not written back to
    disk or to the remote tier) and frees the rest, counted

A fetch that has not finished within `disk_timeout_ms` is given up (`expire`,
on the loop's tick): what was copied and checked becomes ready, the rest is
freed, and lookups count their hits again; a thread that finishes a row of a
fetch given up copies nothing (the check and the copy are under the fetch's
lock), so no byte lands in a slot the loop has freed. Until its threads are
done with its rows (a stalled disk may hold them long), its keys start no
other fetch: a lookup that stops at one answers its hits, not None again.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvd.control.disk_slabs import DiskLoop, DiskPart
from kvd.control.write_behind import complete_fetch
from kvd.errors import KvdError
from kvd.io.disk_threads import Staging, copy_crc, crc32c

if TYPE_CHECKING:
    from kvd.control.pools import Pool
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.disk_reads")
MAX_FETCH_BYTES = 1 << 30  # one lookup's fetch, at most
MAX_READ_BYTES = 2 << 30  # all fetches in flight together: past it, a lookup gets its hits
READER_ACCOUNT = "disk-reader"


@dataclass(eq=False)
class Fetch:
    """One lookup's read from disk into fresh RAM slots."""

    fetch_id: int
    pool: str
    generation: int
    epoch: int
    keys: list[bytes]
    slots: list[int]  # RAM
    disk_slots: list[int]
    crcs: list[int]  # each row's checksum, as its entry says
    deadline: float
    rows: Rows
    part: DiskPart
    lock: threading.Lock = field(default_factory=threading.Lock)
    stood: bool = True  # False once the loop gave it up: threads copy no more
    ok: list[bool] = field(default_factory=list)  # per key, set by the threads
    left: int = 0  # rows not done yet (under `lock`)
    bad: int = 0  # checksum or length
    damaged: list[int] = field(default_factory=list)  # keys' positions: bad rows on disk
    errors: int = 0  # I/O errors
    nbytes: int = 0

    @property
    def owner(self) -> tuple[str, int]:
        return ("disk-fetch", self.fetch_id)


class DiskReads(DiskLoop):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.timeout_s = self.config.disk_timeout_ms / 1000
        self._ids = itertools.count(1)
        self._fetches: dict[int, Fetch] = {}
        self.in_flight = 0  # bytes of the fetches whose rows threads still read
        # (pool, key) -> the fetch given up by its timeout whose rows are still
        # being read: lookups stopping at the key answer their hits meanwhile.
        self._stalled: dict[tuple[str, bytes], int] = {}

    def lookup(self, pool: Pool, keys: Sequence[bytes], hits: int, now: float) -> int | None:
        """A lookup with `hits` leading RAM hits, then a miss: None while the disk's
        run of the keys from the miss on is read into RAM, else `hits` (nothing
        on disk for them, or no room: the next tier's turn)."""
        part = pool.disk
        if part is None or part.resetting or pool.resetting:
            return hits
        if (pool.name, keys[hits]) in self._stalled:  # its last read is still on the disk
            self.counters["disk.stalled_skips"] += 1
            return hits
        row = pool.geometry.row_bytes
        limit = max(1, min(MAX_FETCH_BYTES // row, pool.geometry.num_blocks // 4))
        wanted = list(keys[hits : hits + limit])
        found = part.index.lookup(wanted)
        if found is None:  # the run reaches a block being written: what is ready before it
            is_ready = part.index.is_ready
            found = next((i for i, k in enumerate(wanted) if not is_ready(k)), len(wanted))
        if not found:
            self.counters["disk.misses"] += 1
            return hits
        if self.in_flight + found * row > MAX_READ_BYTES:
            self.counters["disk.reads_refused"] += 1
            return hits
        pool.index.touch(keys[:hits])  # the lookup's own hits are the last to go for room
        owner = ("disk-fetch", next(self._ids))
        n, out = found, None
        while n and out is None:  # what fits, if not the whole run
            out = pool.owned.prepare_store(owner, wanted[:n])
            n //= 2
        if out is None or not out.keys_to_store:
            if out is None:
                self.counters["disk.no_room"] += 1
            return hits
        got, slots = list(out.keys_to_store), list(out.store_spec.slots)
        try:
            spec = part.owned.prepare_load(owner, got, account=READER_ACCOUNT)
        except KvdError as exc:  # the disk's pin cap: not now
            pool.owned.complete_store(owner, got, False)
            log.debug("event=disk_fetch_refused pool=%s reason=%s", pool.name, exc)
            return hits
        disk_slots = list(spec.slots)
        crcs = [part.slab.crcs[s] for s in disk_slots]
        fetch = Fetch(owner[1], pool.name, pool.generation, part.epoch, got, slots, disk_slots,
                      crcs, now + self.timeout_s, self._rows_of(pool), part)  # fmt: skip
        fetch.ok = [False] * len(got)
        fetch.left = len(got)
        self.in_flight += len(got) * row
        self._fetches[fetch.fetch_id] = fetch
        self.counters["disk.fetches"] += 1
        self.threads.submit_many(
            [functools.partial(self._read, fetch, i) for i in range(len(got))], read=True
        )
        return None

    # -- on an I/O thread ----------------------------------------------------

    def _read(self, fetch: Fetch, i: int, staging: Staging) -> None:
        slab = fetch.part.slab
        row = slab.row_bytes
        bad = error = got = 0
        if fetch.stood and slab.enter():
            try:
                buf = staging.get(slab.disk_row_bytes)
                got = slab.read_row(fetch.disk_slots[i], buf)
                if got < row:
                    bad = 1
                    log.info("event=disk_row_short pool=%s slot=%d bytes=%d", fetch.pool,
                             fetch.disk_slots[i], got)  # fmt: skip
                else:
                    key = fetch.keys[i]
                    rows = fetch.rows.view()  # not under the lock: the first maps the pool
                    with fetch.lock:
                        if fetch.stood:
                            at = fetch.slots[i] * row
                            dst = rows[at : at + row]
                            crc = copy_crc(dst, buf[:row], crc32c(key))
                            if crc == fetch.crcs[i]:
                                fetch.ok[i] = True
                            else:
                                bad = 1
                                log.info("event=disk_row_refused pool=%s key=%s reason=checksum",
                                         fetch.pool, key.hex())  # fmt: skip
            except Exception as exc:  # OSError; ValueError: the pool's map went; a bug
                error = 1
                log.info("event=disk_read_failed pool=%s slot=%d reason=%r", fetch.pool,
                         fetch.disk_slots[i], exc)  # fmt: skip
            finally:
                slab.leave()
        with fetch.lock:
            if bad or error:
                fetch.damaged.append(i)
            fetch.bad += bad
            fetch.errors += error
            fetch.nbytes += got
            fetch.left -= 1
            last = fetch.left == 0
        if last:
            self.post(functools.partial(self._fetched, fetch))

    # -- on the loop -----------------------------------------------------------

    def _fetched(self, fetch: Fetch) -> None:
        stalled = self._stalled
        for key in fetch.keys:
            if stalled.get((fetch.pool, key)) == fetch.fetch_id:
                del stalled[(fetch.pool, key)]
        self.in_flight -= len(fetch.keys) * fetch.part.slab.row_bytes
        self.counters["disk.bad_rows"] += fetch.bad
        self.counters["disk.errors"] += fetch.errors
        self.counters["disk.bytes_read"] += fetch.nbytes
        self._unpin(fetch)
        if fetch.stood:
            self._settle(fetch)
        self._forget(fetch)

    def _unpin(self, fetch: Fetch) -> None:
        """The disk rows may be rewritten again (once no thread reads them)."""
        part = fetch.part
        if part.epoch == fetch.epoch and self._current(fetch) is not None:
            part.owned.complete_load(fetch.owner, fetch.keys)

    def _current(self, fetch: Fetch) -> Pool | None:
        pool = self.pools.find(fetch.pool)
        if pool is None or pool.generation != fetch.generation or pool.disk is not fetch.part:
            return None
        return pool

    def _settle(self, fetch: Fetch) -> None:
        with fetch.lock:
            fetch.stood = False
            ok = list(fetch.ok)
        self._fetches.pop(fetch.fetch_id, None)
        pool = self._current(fetch)
        if pool is None:
            return  # the pool went, and its index with it
        done = [k for k, good in zip(fetch.keys, ok, strict=True) if good]
        failed = [k for k, good in zip(fetch.keys, ok, strict=True) if not good]
        complete_fetch(pool, fetch.owner, done, failed, "disk")  # written to no tier again
        self.counters["disk.hits"] += len(done)
        self.counters["disk.fetch_failures"] += len(failed)

    def _forget(self, fetch: Fetch) -> None:
        """Rows that did not read back whole leave the disk index (their entries
        freed), once no thread reads them: not asked for again."""
        part = fetch.part
        if fetch.damaged and part.epoch == fetch.epoch and self._current(fetch) is not None:
            gone = part.index.discard([fetch.keys[i] for i in fetch.damaged])
            self.counters["disk.rows_dropped"] += len(gone)

    def expire(self, now: float) -> None:
        """Gives up the fetches past their deadline."""
        for fetch in list(self._fetches.values()):
            if now >= fetch.deadline:
                self.counters["disk.timeouts"] += 1
                log.info("event=disk_fetch_timeout pool=%s blocks=%d", fetch.pool,
                         len(fetch.keys))  # fmt: skip
                self._settle(fetch)
                for key in fetch.keys:  # until its threads are done with the rows
                    self._stalled[(fetch.pool, key)] = fetch.fetch_id

    def give_up_pool(self, name: str) -> None:
        """A reset or a drop: every fetch of the pool ends now."""
        for fetch in list(self._fetches.values()):
            if fetch.pool == name:
                self._settle(fetch)

    def stop(self) -> None:
        for fetch in list(self._fetches.values()):
            with fetch.lock:
                fetch.stood = False
