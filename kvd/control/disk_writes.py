"""Runs in the daemon: the disk tier's write-behind, on the event loop (SPEC 16).

The blocks that became ready in RAM since the last loop turn (the pool's
`ReadyTap`: stored by engines, or fetched from the remote tier; never those
read from disk) come to `DiskWrites.write`. Those the disk already holds are
skipped; with `disk_admit = "second"` a block goes to disk only the second
time it is stored (a bounded set remembers the first). The rest get disk rows
(`prepare_store` on the disk index: not ready, their entries STORING), are
pinned in RAM under the writer's account (not evicted while a thread reads
them), and go to the I/O threads a row at a time: the row is copied into the
thread's aligned buffer with its CRC-32C (key, then row) computed on the
way, and written. The loop then records each row's checksum, makes its entry
ready (the disk index's slot sink writes it), and unpins the RAM row.

Bytes in flight are bounded by `disk_write_max_bytes`; past the bound, past
the writer's pin cap, while the pool resets, or with no disk row free of
pins, blocks are skipped and counted, never queued. A write that fails is
freed on disk and counted, never retried.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvd.control.disk_slabs import DiskLoop, DiskPart
from kvd.errors import KvdError
from kvd.io.disk_threads import Staging, copy_crc, crc32c

if TYPE_CHECKING:
    from kvd.control.pools import Pool
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.disk_writes")
WRITER_ACCOUNT = "disk-writer"
WRITE_TIMEOUTS = 4  # a write holds its RAM rows at most this many disk_timeout_ms


@dataclass(eq=False)
class Write:
    write_id: int
    pool: str
    generation: int
    epoch: int
    keys: list[bytes]
    slots: list[int]  # RAM
    disk_slots: list[int]
    nbytes: int
    rows: Rows
    part: DiskPart
    lock: threading.Lock = field(default_factory=threading.Lock)
    deadline: float = 0.0  # monotonic: past it the RAM rows are let go (a stalled disk)
    crcs: list[int | None] = field(default_factory=list)  # per key; None: not written
    left: int = 0
    errors: int = 0
    # Under `lock`: False once the loop let the RAM rows go; a thread copies no more.
    stood: bool = True

    @property
    def owner(self) -> tuple[str, int]:
        return ("disk-write", self.write_id)


class DiskWrites(DiskLoop):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.bound = self.config.disk_write_max_bytes
        self.in_flight = 0  # bytes
        self._ids = itertools.count(1)
        self.second = self.config.disk_admit == "second"
        self._writes: dict[int, Write] = {}  # whose RAM rows are still pinned

    def write(self, pool: Pool, keys: list[bytes]) -> None:
        part = pool.disk
        if part is None:
            return
        if part.resetting or pool.resetting:
            self.counters["disk.writes_skipped"] += len(keys)
            return
        on_disk = part.index.is_ready
        there = [k for k in dict.fromkeys(keys) if on_disk(k)]
        if there:  # stored again after RAM let them go: in use, so recent on disk too
            part.index.touch(there)
            keys = [k for k in dict.fromkeys(keys) if not on_disk(k)]
        if self.second:
            keys = self._admitted(part, keys, pool.geometry.num_blocks)
        if not keys:
            return
        row_bytes = pool.geometry.row_bytes
        room = max(0, (self.bound - self.in_flight) // row_bytes)
        # ... and what the writer may pin of the pool (half of it): the rest skipped
        room = min(room, pool.owned.pin_cap - pool.owned.pinned_by(WRITER_ACCOUNT))
        if room < len(keys):
            self.counters["disk.writes_skipped"] += len(keys) - max(0, room)
            keys = keys[: max(0, room)]
        ready = [k for k in keys if pool.index.is_ready(k)]  # not evicted since
        self.counters["disk.writes_skipped"] += len(keys) - len(ready)
        if not ready:
            return
        owner = ("disk-write", next(self._ids))
        out = part.owned.prepare_store(owner, ready)
        if out is None or not out.keys_to_store:
            if out is None:
                self.counters["disk.writes_skipped"] += len(ready)
            return
        keys, disk_slots = list(out.keys_to_store), list(out.store_spec.slots)
        try:
            spec = pool.owned.prepare_load(owner, keys, account=WRITER_ACCOUNT)
        except KvdError as exc:  # the pin cap: skip, never wait
            part.owned.complete_store(owner, keys, False)
            self.counters["disk.writes_skipped"] += len(keys)
            log.debug("event=disk_write_skipped pool=%s reason=%s", pool.name, exc)
            return
        write = Write(owner[1], pool.name, pool.generation, part.epoch, keys, list(spec.slots),
                      disk_slots, len(keys) * row_bytes, self._rows_of(pool), part)  # fmt: skip
        write.crcs = [None] * len(keys)
        write.left = len(keys)
        write.deadline = time.monotonic() + WRITE_TIMEOUTS * self.config.disk_timeout_ms / 1000
        self._writes[write.write_id] = write
        self.in_flight += write.nbytes
        self.counters["disk.write_bytes_peak"] = max(
            self.counters["disk.write_bytes_peak"], self.in_flight
        )
        self.threads.submit_many(
            [functools.partial(self._put, write, i) for i in range(len(keys))], read=False
        )

    def _admitted(self, part: DiskPart, keys: list[bytes], ram_blocks: int) -> list[bytes]:
        """disk_admit = "second": the keys stored once before (remembered, at most
        ten times the pool's blocks, oldest forgotten first)."""
        seen, admitted = part.seen, []
        for key in keys:
            if key in seen:
                del seen[key]
                admitted.append(key)
            else:
                seen[key] = None
        while len(seen) > 10 * ram_blocks:
            del seen[next(iter(seen))]
        self.counters["disk.writes_deferred"] += len(keys) - len(admitted)
        return admitted

    # -- on an I/O thread ----------------------------------------------------

    def _put(self, write: Write, i: int, staging: Staging) -> None:
        slab = write.part.slab
        row = slab.row_bytes
        crc = None
        error = 0
        if write.stood and slab.enter():
            try:
                buf = staging.get(slab.disk_row_bytes)
                rows = write.rows.view()  # not under the lock: the first maps the pool
                at = write.slots[i] * row
                with write.lock:  # the RAM row is pinned while the write stands
                    if write.stood:
                        crc = copy_crc(buf[:row], rows[at : at + row], crc32c(write.keys[i]))
                if crc is not None:
                    buf[row:] = bytes(len(buf) - row)  # the padding: no other row's bytes
                    if slab.write_row(write.disk_slots[i], buf) < slab.disk_row_bytes:
                        raise OSError("short write")
            except Exception as exc:  # OSError; ValueError: the pool's map went; a bug
                crc, error = None, 1
                log.info("event=disk_write_failed pool=%s slot=%d reason=%r", write.pool,
                         write.disk_slots[i], exc)  # fmt: skip
            finally:
                slab.leave()
        with write.lock:
            write.crcs[i] = crc
            write.errors += error
            write.left -= 1
            last = write.left == 0
        if last:
            self.post(functools.partial(self._written, write))

    # -- on the loop -----------------------------------------------------------

    def _written(self, write: Write) -> None:
        self.in_flight -= write.nbytes
        self.counters["disk.errors"] += write.errors
        self._release(write)
        pool = self.pools.find(write.pool)
        part = write.part
        if pool is None or pool.disk is not part or part.epoch != write.epoch:
            return  # reset or dropped meanwhile: the rows' entries are gone already
        done = [k for k, c in zip(write.keys, write.crcs, strict=True) if c is not None]
        failed = [k for k, c in zip(write.keys, write.crcs, strict=True) if c is None]
        crcs = part.slab.crcs
        for slot, crc in zip(write.disk_slots, write.crcs, strict=True):
            if crc is not None:
                crcs[slot] = crc  # before the entry says READY
        if done:
            part.owned.complete_store(write.owner, done, True)
        if failed:
            part.owned.complete_store(write.owner, failed, False)
        self.counters["disk.blocks_written"] += len(done)
        self.counters["disk.bytes_written"] += len(done) * part.slab.disk_row_bytes
        self.counters["disk.writes_failed"] += len(failed)

    def _release(self, write: Write) -> None:
        """Unpins the write's RAM rows (once): after this no thread copies them."""
        if self._writes.pop(write.write_id, None) is None:
            return
        with write.lock:
            write.stood = False
        pool = self.pools.find(write.pool)
        if pool is not None and pool.generation == write.generation:
            pool.owned.complete_load(write.owner, write.keys)

    def expire(self, now: float) -> None:
        """Lets go of the RAM rows of writes stuck past their deadline (a stalled
        disk): the pool may evict them, and a reset can finish. The rows copied
        before are still made ready on disk once written."""
        for write in list(self._writes.values()):
            if now >= write.deadline:
                self.counters["disk.write_timeouts"] += 1
                log.info("event=disk_write_timeout pool=%s blocks=%d", write.pool,
                         len(write.keys))  # fmt: skip
                self._release(write)

    def give_up_pool(self, name: str) -> None:
        """A reset: the pool's writes let go of their RAM rows now."""
        for write in list(self._writes.values()):
            if write.pool == name:
                self._release(write)
