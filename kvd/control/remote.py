"""Runs in the daemon: the remote tier's rules, on the event loop (SPEC section 14).

`RemoteTier` decides what goes to the remote store and what comes back;
two `RemoteThread`s (one fetching, one writing) do the calls, so the loop
never waits on the remote tier. Every step on the index happens here, on
the loop; the threads only call the store and copy bytes.

Read-through, for a `Lookup` whose leading local hits end at a miss:

    miss   -> probe: EXISTS of the keys from the miss on (one pipelined call);
              lookups that stop at one of those keys answer None meanwhile
    probed -> the leading run of present keys gets slots (`prepare_store`
              under the fetch's own owner: not ready, so lookups still
              answer None); a key the store lacks is not asked for again
              for `remote_miss_ms`
    fetch  -> GET in pipelined chunks; each value's header, key and length
              are checked, its row copied into its slot with its CRC-32C
              computed on the way; a block whose checksum fails is freed
    done   -> the verified blocks become ready (one stored event, as for any
              store); the rest are freed and counted

A fetch that makes no progress for `remote_timeout_ms` is given up at the
next tick: what was copied and checked becomes ready, the rest is freed,
and lookups count their hits again. The thread copies into a slot only
under the fetch's lock and only while the fetch stands, so no byte lands in
a slot once the loop has freed it.

Write-behind, for every block that becomes ready from a store (`ReadyTap`,
the pool's slot sink): the block is pinned under the writer's owner (so its
slot is not reused while the thread reads it), read, written with one SET,
and unpinned. Bytes in flight are bounded by `remote_write_max_bytes`;
blocks past the bound, or while the tier is down, are skipped and counted,
never queued. Blocks fetched from the tier are not written back.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.config import Config
from kvd.errors import KvdError
from kvd.io.remote_store import Link, RemoteDown, RemoteStore, RemoteThread
from kvd.io.remote_value import BadValue, copy_value, encode_value, remote_key

if TYPE_CHECKING:
    from kvd.control.pools import Pool, PoolRegistry
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.remote")
MAX_MISSES = 200_000  # keys remembered as absent from the remote tier
CHUNK_BYTES = 16 << 20  # values per pipelined GET or SET, by bytes
MAX_PROBE_KEYS = 4096
HEALTH_EVERY_S = 1.0  # an idle tier is pinged this often, for its state


class ReadyTap:
    """A pool's slot sink (the segment's slot table) with a tap: remembers the
    keys that became ready, for the write-behind, unless `muted`."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.keys: list[bytes] = []
        self.muted = False

    def ready(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        self.inner.ready(slots, keys)  # type: ignore[attr-defined]
        if not self.muted:
            self.keys.extend(keys)

    def freed(self, slots: Sequence[int]) -> None:
        self.inner.freed(slots)  # type: ignore[attr-defined]

    def reset(self) -> None:
        self.inner.reset()  # type: ignore[attr-defined]
        self.keys.clear()


@dataclass(eq=False)
class Fetch:
    """One lookup's read-through, from its probe to its last block."""

    fetch_id: int
    pool: str
    generation: int
    row_bytes: int
    fingerprint: str
    keys: list[bytes]  # probed; after `probed`, the keys given slots
    deadline: float  # monotonic: the loop gives up past it (moved on by progress)
    slots: list[int] = field(default_factory=list)
    rows: Rows | None = None
    # Shared with the thread, under `lock`:
    lock: threading.Lock = field(default_factory=threading.Lock)
    stood: bool = True  # False once the loop gave it up: the thread copies no more
    copied: list[bytes] = field(default_factory=list)  # verified and in their slots
    progress: float = 0.0  # monotonic, of the last block copied
    parts: int = 0  # fetch threads still getting its values (loop only)

    @property
    def owner(self) -> tuple[str, int]:
        return ("remote-fetch", self.fetch_id)


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


WRITER_ACCOUNT = "remote-writer"


class RemoteTier:
    def __init__(
        self,
        config: Config,
        pools: PoolRegistry,
        counters: Counter[str],
        fetchers: Sequence[RemoteThread],
        writer: RemoteThread,
        link: Link,
    ) -> None:
        self.config = config
        self.pools = pools
        self.counters = counters
        self.fetchers = list(fetchers)  # the first also probes and pings
        self.fetcher = self.fetchers[0]
        self.writer = writer
        self.link = link
        self.timeout_s = config.remote_timeout_ms / 1000
        self.write_bound = config.remote_write_max_bytes
        self.write_bytes = 0  # in flight
        self._ids = itertools.count(1)
        # (pool, key) -> the fetch that probes it: lookups stopping there wait.
        self._probing: dict[tuple[str, bytes], Fetch] = {}
        self._fetches: dict[int, Fetch] = {}
        self._writes: dict[int, Write] = {}
        self._misses: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._rows: dict[tuple[str, int], Rows] = {}
        self._pinging = False
        self._pinged_at = 0.0

    @property
    def down(self) -> bool:
        """The tier failed and has not come back (not merely: not connected yet)."""
        return not self.link.up and self.link.changes > 0

    # -- read-through (loop) ---------------------------------------------------

    def lookup(self, pool: Pool, keys: Sequence[bytes], hits: int, now: float) -> int | None:
        """A lookup that found `hits` leading local hits and then a miss: None while
        the remote tier is asked for the rest, else `hits`."""
        first = keys[hits]
        fetch = self._probing.get((pool.name, first))
        if fetch is not None:
            if now < fetch.deadline:
                return None
            self._give_up(fetch)
            return hits
        missed = self._misses.get((pool.name, first))
        if missed is not None:
            if now < missed:
                return hits
            del self._misses[(pool.name, first)]
        if self.down:
            self.counters["remote.skipped_down"] += 1
            return hits
        if pool.resetting or now < pool.stores_from:
            return hits
        limit = max(1, self.config.remote_fetch_max_bytes // pool.geometry.row_bytes)
        wanted = [k for k in keys[hits : hits + min(limit, MAX_PROBE_KEYS)]]
        fetch = Fetch(
            next(self._ids), pool.name, pool.generation, pool.geometry.row_bytes,
            pool.fingerprint, wanted, now + self.timeout_s,
        )  # fmt: skip
        self._fetches[fetch.fetch_id] = fetch
        for k in wanted:
            self._probing.setdefault((pool.name, k), fetch)
        self.counters["remote.probes"] += 1
        self.fetcher.submit(lambda store: self._probe(store, fetch))
        return None

    def _probe(self, store: RemoteStore, fetch: Fetch) -> Callable[[], None]:
        """On the fetch thread: which of the fetch's keys the store has."""
        names = [remote_key(self.config.remote_prefix, fetch.fingerprint, k) for k in fetch.keys]
        try:
            present = store.exists(names)
        except RemoteDown as exc:
            reason = str(exc)
            return lambda: self._probe_failed(fetch, reason)
        return lambda: self._probed(fetch, present)

    def _probe_failed(self, fetch: Fetch, reason: str) -> None:
        self.counters["remote.errors"] += 1
        log.debug("event=remote_probe_failed pool=%s reason=%s", fetch.pool, reason)
        self._unprobe(fetch)
        self._fetches.pop(fetch.fetch_id, None)

    def _unprobe(self, fetch: Fetch) -> None:
        for k in fetch.keys:
            if self._probing.get((fetch.pool, k)) is fetch:
                del self._probing[(fetch.pool, k)]

    def _miss(self, pool: str, key: bytes, now: float) -> None:
        misses = self._misses
        misses[(pool, key)] = now + self.config.remote_miss_ms / 1000
        misses.move_to_end((pool, key))
        while len(misses) > MAX_MISSES:
            misses.popitem(last=False)

    def _probed(self, fetch: Fetch, present: list[bool]) -> None:
        now = time.monotonic()
        self._unprobe(fetch)
        if not fetch.stood or fetch.fetch_id not in self._fetches:
            return  # given up already: lookups counted their hits
        n = next((i for i, here in enumerate(present) if not here), len(present))
        if n < len(present):
            self._miss(fetch.pool, fetch.keys[n], now)
        pool = self.pools.find(fetch.pool)
        if n == 0 or pool is None or pool.generation != fetch.generation:
            self.counters["remote.misses"] += 1
            del self._fetches[fetch.fetch_id]
            return
        if pool.resetting or now < pool.stores_from:
            del self._fetches[fetch.fetch_id]
            return
        out = pool.owned.prepare_store(fetch.owner, fetch.keys[:n])
        if out is None or not out.keys_to_store:
            if out is None:
                self.counters["remote.no_room"] += 1
                self._miss(fetch.pool, fetch.keys[0], now)
            del self._fetches[fetch.fetch_id]
            return
        fetch.keys, fetch.slots = list(out.keys_to_store), list(out.store_spec.slots)
        fetch.rows = self._rows_of(pool)
        fetch.deadline = now + self.timeout_s
        # The chunks in turn to each fetch thread, each on its own connection:
        # one receives while another checks and copies.
        n = min(len(self.fetchers), -(-len(fetch.keys) // self._per_chunk(fetch.row_bytes)))
        fetch.parts = n
        for part, thread in enumerate(self.fetchers[:n]):
            thread.submit(functools.partial(self._get, fetch=fetch, part=part, parts=n))

    @staticmethod
    def _per_chunk(row_bytes: int) -> int:
        return max(1, CHUNK_BYTES // row_bytes)

    def _get(
        self, store: RemoteStore, *, fetch: Fetch, part: int, parts: int
    ) -> Callable[[], None]:
        """On a fetch thread: chunks `part`, `part + parts`, ... of the fetch's values,
        checked and copied into their slots."""
        row_bytes, prefix = fetch.row_bytes, self.config.remote_prefix
        assert fetch.rows is not None
        rows = fetch.rows.view()
        per_chunk = self._per_chunk(row_bytes)
        bad = nbytes = 0
        error = ""
        for start in range(part * per_chunk, len(fetch.keys), parts * per_chunk):
            keys = fetch.keys[start : start + per_chunk]
            slots = fetch.slots[start : start + per_chunk]
            try:
                values = store.get([remote_key(prefix, fetch.fingerprint, k) for k in keys])
            except RemoteDown as exc:
                error = str(exc)
                break
            for key, slot, value in zip(keys, slots, values, strict=True):
                if value is None:
                    continue  # gone since the probe (expired or evicted there)
                nbytes += len(value)
                offset = slot * row_bytes
                with fetch.lock:  # copied and checked in one pass, into its own slot
                    if not fetch.stood:
                        return lambda: None
                    try:
                        copy_value(rows[offset : offset + row_bytes], value, key, row_bytes)
                    except BadValue as exc:
                        bad += 1
                        log.info("event=remote_value_refused pool=%s key=%s reason=%s",
                                 fetch.pool, key.hex(), exc)  # fmt: skip
                        continue
                    fetch.copied.append(key)
                    fetch.progress = time.monotonic()
        return lambda: self._fetched(fetch, bad, nbytes, error)

    def _fetched(self, fetch: Fetch, bad: int, nbytes: int, error: str) -> None:
        self.counters["remote.bad_values"] += bad
        self.counters["remote.bytes_read"] += nbytes
        if error:
            self.counters["remote.errors"] += 1
        fetch.parts -= 1
        if fetch.stood and fetch.parts == 0:
            self._settle(fetch)

    def _give_up(self, fetch: Fetch) -> None:
        """The loop stops waiting for `fetch`: after this the thread copies nothing."""
        with fetch.lock:
            fetch.stood = False
        self.counters["remote.timeouts"] += 1
        self._unprobe(fetch)
        if fetch.slots:
            self._settle(fetch)
        else:
            self._fetches.pop(fetch.fetch_id, None)

    def _settle(self, fetch: Fetch) -> None:
        with fetch.lock:
            fetch.stood = False
            copied = list(fetch.copied)
        self._fetches.pop(fetch.fetch_id, None)
        pool = self.pools.find(fetch.pool)
        if pool is None or pool.generation != fetch.generation:
            return  # the pool went, and its index with it
        now = time.monotonic()
        done = set(copied)
        failed = [k for k in fetch.keys if k not in done]
        for k in failed:
            self._miss(fetch.pool, k, now)
        tap = pool.tap
        if tap is not None:
            tap.muted = True  # fetched blocks are not written back
        try:
            if copied:
                pool.owned.complete_store(fetch.owner, copied, True)
            if failed:
                pool.owned.complete_store(fetch.owner, failed, False)
        finally:
            if tap is not None:
                tap.muted = False
        self.counters["remote.hits"] += len(copied)
        self.counters["remote.fetch_failures"] += len(failed)

    # -- write-behind (loop) ---------------------------------------------------

    def pump(self) -> None:
        """Starts the writes of the blocks that became ready since the last call."""
        for pool in self.pools:
            tap = pool.tap
            if tap is None or not tap.keys:
                continue
            keys, tap.keys = tap.keys, []
            self._write(pool, keys)

    def _write(self, pool: Pool, keys: list[bytes]) -> None:
        row_bytes = pool.geometry.row_bytes
        if self.down or pool.resetting:
            self.counters["remote.writes_skipped"] += len(keys)
            return
        room = max(0, (self.write_bound - self.write_bytes) // row_bytes)
        if room < len(keys):
            self.counters["remote.writes_skipped"] += len(keys) - room
            keys = keys[:room]
        if not keys:
            return
        ready = [k for k in keys if pool.index.is_ready(k)] if keys else []
        write = Write(next(self._ids), pool.name, pool.generation, ready, [], 0)
        try:
            spec = pool.owned.prepare_load(write.owner, ready, account=WRITER_ACCOUNT)
        except KvdError as exc:  # the pin cap: skip, never wait
            self.counters["remote.writes_skipped"] += len(ready)
            log.debug("event=remote_write_skipped pool=%s reason=%s", pool.name, exc)
            return
        self.counters["remote.writes_skipped"] += len(keys) - len(ready)
        write.slots = list(spec.slots)
        write.nbytes = len(ready) * row_bytes
        self.write_bytes += write.nbytes
        peak = self.counters["remote.write_bytes_peak"]
        self.counters["remote.write_bytes_peak"] = max(peak, self.write_bytes)
        self._writes[write.write_id] = write
        rows, fingerprint = self._rows_of(pool), pool.fingerprint
        self.writer.submit(lambda store: self._put(store, write, rows, row_bytes, fingerprint))

    def _put(
        self, store: RemoteStore, write: Write, mapped: Rows, row_bytes: int, fp: str
    ) -> Callable[[], None]:
        """On the write thread: each pinned row, with its header, in one SET."""
        rows = mapped.view()
        prefix, ttl = self.config.remote_prefix, self.config.remote_ttl_s
        per_chunk = max(1, CHUNK_BYTES // row_bytes)
        written = 0
        error = ""
        for start in range(0, len(write.keys), per_chunk):
            items = []
            for key, slot in zip(write.keys[start : start + per_chunk],
                                 write.slots[start : start + per_chunk], strict=True):  # fmt: skip
                row = rows[slot * row_bytes : (slot + 1) * row_bytes]
                items.append((remote_key(prefix, fp, key), encode_value(key, row)))
            try:
                store.put(items, ttl)
            except RemoteDown as exc:
                error = str(exc)
                break
            written += sum(len(v) for _, v in items)
        return lambda: self._written(write, written, error)

    def _written(self, write: Write, nbytes: int, error: str) -> None:
        self._writes.pop(write.write_id, None)
        self.write_bytes -= write.nbytes
        self.counters["remote.bytes_written"] += nbytes
        if error:
            self.counters["remote.errors"] += 1
        else:
            self.counters["remote.blocks_written"] += len(write.keys)
        pool = self.pools.find(write.pool)
        if pool is not None and pool.generation == write.generation:
            pool.owned.complete_load(write.owner, write.keys)

    # -- upkeep (loop) ---------------------------------------------------------

    def tick(self, now: float) -> None:
        """Gives up the fetches that made no progress within the timeout."""
        for fetch in list(self._fetches.values()):
            if now >= max(fetch.deadline, fetch.progress + self.timeout_s):
                self._give_up(fetch)
        if not self._pinging and (not self.link.up or now - self._pinged_at >= HEALTH_EVERY_S):
            # Down, or not connected yet: the fetch thread reconnects (after its
            # backoff), and requests meanwhile do not ask the remote tier. Up: a
            # ping now and then, so that the state is true without traffic.
            self._pinging = True
            self._pinged_at = now
            self.fetcher.submit(self._ping)
        for pool in self.pools:  # a new pool's rows are mapped off the loop, ahead of use
            if (pool.name, pool.generation) not in self._rows:
                self.writer.submit(functools.partial(self._mapped, self._rows_of(pool)))
        for name, generation in list(self._rows):  # a dropped pool's pages go with its map
            live = self.pools.find(name)
            if live is None or live.generation != generation:
                del self._rows[(name, generation)]
        self.counters["remote.connected"] = int(self.link.up)
        self.counters["remote.write_bytes_in_flight"] = self.write_bytes

    @staticmethod
    def _mapped(rows: Rows, store: RemoteStore) -> Callable[[], None]:
        rows.view()
        return lambda: None

    def _ping(self, store: RemoteStore) -> Callable[[], None]:
        try:
            store.ping()
        except RemoteDown:
            time.sleep(0.05)  # the store backs off; this only keeps the thread from spinning
        return self._pinged

    def _pinged(self) -> None:
        self._pinging = False

    def _rows_of(self, pool: Pool) -> Rows:
        key = (pool.name, pool.generation)
        rows = self._rows.get(key)
        if rows is None:
            for old in [k for k in self._rows if k[0] == pool.name]:
                del self._rows[old]  # an earlier generation's mapping goes when unused
            rows = pool.region.rows()
            self._rows[key] = rows
        return rows

    def close(self) -> None:
        for fetch in list(self._fetches.values()):
            with fetch.lock:
                fetch.stood = False
        for thread in [*self.fetchers, self.writer]:
            thread.close(1.0)
