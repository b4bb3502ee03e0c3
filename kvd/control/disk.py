"""Runs in the daemon: the disk tier on the event loop, its I/O threads and its upkeep (SPEC 16).

`DiskTier` puts together the reads (`kvd.control.disk_reads`) and the
write-behind (`kvd.control.disk_writes`) over one set of I/O threads
(`kvd.io.disk_threads`), so the loop never waits on the disk; each pool's
slab and disk index are its `DiskPart` (`kvd.control.disk_slabs`), made with
the pool. `tick` gives up reads past `disk_timeout_ms`, syncs the slabs'
entry tables now and then (SYNC_EVERY_S: after a power loss the table names
fewer rows, never other ones), and keeps the tier's gauges.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvd.config import Config
from kvd.control.disk_reads import DiskReads
from kvd.control.disk_writes import DiskWrites
from kvd.io.disk_threads import DiskThreads, Staging

if TYPE_CHECKING:
    from kvd.control.pools import Pool, PoolRegistry
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.disk")
SYNC_EVERY_S = 5.0


class DiskTier:
    def __init__(
        self,
        config: Config,
        pools: PoolRegistry,
        counters: Counter[str],
        post: Callable[[Callable[[], None]], object],
    ) -> None:
        self.config = config
        self.pools = pools
        self.counters = counters
        self.threads = DiskThreads(config.disk_queue_depth)
        self._rows: dict[tuple[str, int], Rows] = {}
        self.read = DiskReads(config, pools, counters, self.threads, post, self._rows_of)
        self.write = DiskWrites(config, pools, counters, self.threads, post, self._rows_of)
        self._synced_at = 0.0
        self._syncing = False
        counters["disk.capacity_bytes"] = 0  # set: the disk metrics are exported from now on
        log.info("event=disk_tier dir=%s bytes=%d queue_depth=%d write_max_bytes=%d "
                 "timeout_ms=%d admit=%s", config.disk_dir, pools.disk.total if pools.disk else 0,
                 config.disk_queue_depth, config.disk_write_max_bytes, config.disk_timeout_ms,
                 config.disk_admit)  # fmt: skip

    def lookup(self, pool: Pool, keys: Sequence[bytes], hits: int, now: float) -> int | None:
        return self.read.lookup(pool, keys, hits, now)

    def write_ready(self, pool: Pool, keys: list[bytes]) -> None:
        self.write.write(pool, keys)

    def begin_reset(self, pool: Pool) -> None:
        """The pool's reads and writes let go of its RAM slots now (so the reset
        can finish whatever the disk does); its entries stop saying READY."""
        if pool.disk is not None:
            self.read.give_up_pool(pool.name)
            self.write.give_up_pool(pool.name)
            pool.disk.begin_reset()

    def tick(self, now: float) -> None:
        self.read.expire(now)
        self.write.expire(now)
        for pool in self.pools:  # a new pool's rows are mapped off the loop, ahead of use
            if pool.disk is not None and (pool.name, pool.generation) not in self._rows:
                self.threads.submit(functools.partial(_map, self._rows_of(pool)), read=False)
        for name, generation in list(self._rows):  # a dropped pool's pages go with its map
            live = self.pools.find(name)
            if live is None or live.generation != generation:
                del self._rows[(name, generation)]
        if not self._syncing and now - self._synced_at >= SYNC_EVERY_S:
            self._synced_at = now
            slabs = [p.disk.slab for p in self.pools if p.disk is not None]
            if slabs:
                self._syncing = True
                threading.Thread(target=self._sync, args=(slabs,), name="kvd-disk-sync",
                                 daemon=True).start()  # fmt: skip
        c = self.counters
        parts = [p.disk for p in self.pools if p.disk is not None]
        c["disk.bytes_used"] = sum(part.bytes_used for part in parts)
        c["disk.blocks"] = sum(part.index.num_ready for part in parts)
        c["disk.capacity_bytes"] = sum(part.slab.num_blocks * part.slab.disk_row_bytes
                                       for part in parts)  # fmt: skip
        c["disk.write_bytes_in_flight"] = self.write.in_flight
        c["disk.read_bytes_in_flight"] = self.read.in_flight
        c["disk.slabs_failed"] = self.pools.disk.failed if self.pools.disk else 0

    def _sync(self, slabs: list) -> None:  # type: ignore[type-arg]
        try:
            for slab in slabs:
                slab.sync()
        finally:
            self._syncing = False

    def _rows_of(self, pool: Pool) -> Rows:
        key = (pool.name, pool.generation)
        rows = self._rows.get(key)
        if rows is None:
            for old in [k for k in self._rows if k[0] == pool.name]:
                del self._rows[old]
            rows = pool.region.rows()
            self._rows[key] = rows
        return rows

    def close(self) -> None:
        self.read.stop()
        self.threads.close(2.0)


def _map(rows: Rows, _staging: Staging) -> None:
    try:
        rows.view()
    except Exception as exc:  # the pool was dropped first: nothing to map
        log.debug("event=disk_map_skipped shm=%s reason=%r", rows.name, exc)
