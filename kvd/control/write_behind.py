"""Runs in the daemon: the remote tier's write-behind, on the event loop (SPEC 14).

Every block that becomes ready from a store is seen by the pool's `ReadyTap`
(its slot sink). After each loop turn (`Service.pump_tiers`), `WriteBehind.write`
pins those blocks
under the writer's owner (so their slots are not reused while the thread
reads them), and the write thread reads each row, puts its header before it
and writes it with a pipelined SET; the loop then unpins. Bytes in flight
are bounded by `remote_write_max_bytes`; blocks past the bound, past the
writer's pin cap (half a pool), while the tier is down or the pool resets,
or evicted before the pump are skipped and counted, never queued. Blocks
fetched from the tier are not written back (the tap's `source` says so). A write
that fails is not retried.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.config import Config
from kvd.core.index.types import SlotSink
from kvd.errors import KvdError
from kvd.io.remote_store import RemoteError, RemoteStore, RemoteThread
from kvd.io.remote_value import encode_value, remote_key

if TYPE_CHECKING:
    from kvd.control.pools import Pool, PoolRegistry
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.write_behind")
CHUNK_BYTES = 16 << 20  # values per pipelined SET, by bytes
WRITER_ACCOUNT = "remote-writer"


class ReadyTap:
    """A pool's slot sink (the segment's slot table) with a tap: remembers the
    keys that became ready, for the tiers below RAM, by where they came from
    (`source`, set around the completions that make them ready): `keys`, stored
    by engines (both tiers write them); `fetched`, from the remote tier (the
    disk tier writes them); read from disk: neither."""

    def __init__(self, inner: SlotSink) -> None:
        self.inner = inner
        self.keys: list[bytes] = []
        self.fetched: list[bytes] = []
        self.source = "store"  # "store", "remote" or "disk"

    def storing(self, slots: Sequence[int]) -> None:
        self.inner.storing(slots)

    def ready(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        self.inner.ready(slots, keys)
        if self.source == "store":
            self.keys.extend(keys)
        elif self.source == "remote":
            self.fetched.extend(keys)

    def freed(self, slots: Sequence[int]) -> None:
        self.inner.freed(slots)

    def pinned(self, slots: Sequence[int]) -> None:
        self.inner.pinned(slots)

    def unpinned(self, slots: Sequence[int]) -> None:
        self.inner.unpinned(slots)

    def reset(self) -> None:
        self.inner.reset()
        self.keys.clear()
        self.fetched.clear()

    def take(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, fetched) since the last call."""
        keys, fetched = self.keys, self.fetched
        self.keys, self.fetched = [], []
        return keys, fetched


def complete_fetch(
    pool: Pool, owner: object, done: Sequence[bytes], failed: Sequence[bytes], source: str
) -> None:
    """Ends a lower tier's fetch into `pool`'s RAM: `done` ready, `failed` freed,
    the pool's tap told where the ready ones came from (`ReadyTap.source`)."""
    tap = pool.tap
    if tap is not None:
        tap.source = source
    try:
        if done:
            pool.owned.complete_store(owner, done, True)
        if failed:
            pool.owned.complete_store(owner, failed, False)
    finally:
        if tap is not None:
            tap.source = "store"


@dataclass(eq=False)
class Write:
    write_id: int
    pool: str
    generation: int
    keys: list[bytes]
    slots: list[int]
    nbytes: int

    @property
    def owner(self) -> tuple[str, int]:
        return ("remote-write", self.write_id)


class WriteBehind:
    def __init__(
        self,
        config: Config,
        pools: PoolRegistry,
        counters: Counter[str],
        writer: RemoteThread,
        down: Callable[[], bool],
        rows_of: Callable[[Pool], Rows],
    ) -> None:
        self.config = config
        self.pools = pools
        self.counters = counters
        self.writer = writer
        self._down = down
        self._rows_of = rows_of
        self.write_bound = config.remote_write_max_bytes
        self.write_bytes = 0  # in flight
        self._ids = itertools.count(1)
        self._writes: dict[int, Write] = {}

    def write(self, pool: Pool, keys: list[bytes]) -> None:
        """Starts the writes of `keys`, blocks of `pool` that became ready."""
        if keys:
            self._write(pool, keys)

    def _write(self, pool: Pool, keys: list[bytes]) -> None:
        row_bytes = pool.geometry.row_bytes
        if self._down() or pool.resetting:
            self.counters["remote.writes_skipped"] += len(keys)
            return
        room = max(0, (self.write_bound - self.write_bytes) // row_bytes)
        if room < len(keys):
            self.counters["remote.writes_skipped"] += len(keys) - room
            keys = keys[:room]
        if not keys:
            return
        ready = [k for k in keys if pool.index.is_ready(k)]  # not evicted since
        self.counters["remote.writes_skipped"] += len(keys) - len(ready)
        if not ready:
            return
        write = Write(next(self._ids), pool.name, pool.generation, ready, [], 0)
        try:
            spec = pool.owned.prepare_load(write.owner, ready, account=WRITER_ACCOUNT)
        except KvdError as exc:  # the pin cap: skip, never wait
            self.counters["remote.writes_skipped"] += len(ready)
            log.debug("event=remote_write_skipped pool=%s reason=%s", pool.name, exc)
            return
        write.slots = list(spec.slots)
        write.nbytes = len(ready) * row_bytes
        self.write_bytes += write.nbytes
        peak = self.counters["remote.write_bytes_peak"]
        self.counters["remote.write_bytes_peak"] = max(peak, self.write_bytes)
        self._writes[write.write_id] = write
        rows, fingerprint = self._rows_of(pool), pool.fingerprint
        self.writer.submit(
            functools.partial(self._put, write=write, mapped=rows, row_bytes=row_bytes,
                              fp=fingerprint)
        )  # fmt: skip

    def _put(
        self, store: RemoteStore, *, write: Write, mapped: Rows, row_bytes: int, fp: str
    ) -> Callable[[], None]:
        """On the write thread: each pinned row, with its header, a pipelined SET
        per chunk. The loop part always runs: it unpins."""
        prefix, ttl = self.config.remote_prefix, self.config.remote_ttl_s
        per_chunk = max(1, CHUNK_BYTES // row_bytes)
        blocks = nbytes = 0
        error = ""
        try:
            rows = mapped.view()
            for start in range(0, len(write.keys), per_chunk):
                items = []
                keys = write.keys[start : start + per_chunk]
                slots = write.slots[start : start + per_chunk]
                for key, slot in zip(keys, slots, strict=True):
                    row = rows[slot * row_bytes : (slot + 1) * row_bytes]
                    items.append((remote_key(prefix, fp, key), encode_value(key, row)))
                store.put(items, ttl)
                blocks += len(items)
                nbytes += sum(len(v) for _, v in items)
        except Exception as exc:  # RemoteError, or a bug (a dropped pool's map)
            error = str(exc) if isinstance(exc, RemoteError) else repr(exc)
        return lambda: self._written(write, blocks, nbytes, error)

    def _written(self, write: Write, blocks: int, nbytes: int, error: str) -> None:
        self._writes.pop(write.write_id, None)
        self.write_bytes -= write.nbytes
        self.counters["remote.bytes_written"] += nbytes
        self.counters["remote.blocks_written"] += blocks
        if error:
            self.counters["remote.errors"] += 1
            self.counters["remote.writes_failed"] += len(write.keys) - blocks
            log.debug("event=remote_write_failed pool=%s reason=%s", write.pool, error)
        pool = self.pools.find(write.pool)
        if pool is not None and pool.generation == write.generation:
            pool.owned.complete_load(write.owner, write.keys)
