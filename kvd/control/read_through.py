"""Runs in the daemon: the remote tier's read-through, on the event loop (SPEC 14).

A `Lookup` whose leading local hits end at a miss comes here (`ReadThrough.lookup`):

    miss   -> probe: EXISTS of the keys from the miss on (one pipelined call);
              lookups that stop at one of those keys answer None meanwhile
    probed -> the leading run of present keys (at most remote_fetch_max_bytes
              and a quarter of the pool; less if that is what fits) gets
              slots, `prepare_store` under the fetch's own owner: not ready, so
              lookups still answer None; the lookup's own local hits are
              touched first, so they are the last to go for the room; a key
              the store lacks is not asked for again for `remote_miss_ms`
    fetch  -> GET in pipelined chunks on the fetch thread; each value's header,
              key and length are checked, its row copied into its slot with
              its CRC-32C computed on the way
    done   -> the blocks that checked out become ready (one stored event, as
              for any store); the rest are freed and counted

Probes wait on the loop, at most `MAX_WAITING_PROBES`, and go to the thread
`PROBES_AT_ONCE` at a time: a slow tier never builds a backlog on the
thread. A probe whose lookup gave up (its timeout passed) before its turn
is dropped, never sent (the thread checks again before it sends), and its
first key is not probed again for `remote_miss_ms`: an engine asking again
about the same keys waits on one probe, or gets its hits. A lookup that
finds the queue full gets its hits at once (`remote.probes_refused`).

`expire` gives up a fetch whose probe had no answer within `remote_timeout_ms`,
or that received nothing for that long once its GETs started (or waited for
the thread four timeouts): what was copied and checked becomes ready, the
rest is freed, and lookups count their hits again. The thread copies into a
slot only under the fetch's lock and only while the fetch stands, so no byte
lands in a slot once the loop has freed it; it checks before each chunk too,
so a fetch given up stops downloading. Every thread call returns its loop
part, even when it fails, so no owner is left on a pool's index.
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
from kvd.control.write_behind import complete_fetch
from kvd.io.remote_store import RemoteError, RemoteStore, RemoteThread
from kvd.io.remote_value import BadValue, copy_value, remote_key

if TYPE_CHECKING:
    from kvd.control.pools import Pool, PoolRegistry
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.read_through")
MAX_MISSES = 200_000  # keys remembered as absent from the remote tier
CHUNK_BYTES = 16 << 20  # values per pipelined GET, by bytes
MAX_PROBE_KEYS = 4096
MAX_WAITING_PROBES = 128  # probes not yet handed to the fetch thread, at most
PROBES_AT_ONCE = 2  # probes handed to the fetch thread and not yet answered, at most
QUEUED_TIMEOUTS = 4  # a fetch waiting for the thread is given up after this many timeouts


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
    progress: float = 0.0  # monotonic: when the thread started it, then of its last block
    queued_at: float = 0.0  # monotonic: when its GETs were handed to the thread
    leading: list[bytes] = field(default_factory=list)  # the lookup's local hits

    @property
    def owner(self) -> tuple[str, int]:
        return ("remote-fetch", self.fetch_id)

    def standing(self) -> bool:
        """Whether the loop still waits for it (read by the thread: the loop may
        set `stood` to False at any time)."""
        return self.stood


class ReadThrough:
    def __init__(
        self,
        config: Config,
        pools: PoolRegistry,
        counters: Counter[str],
        fetcher: RemoteThread,
        down: Callable[[], bool],
        rows_of: Callable[[Pool], Rows],
    ) -> None:
        self.config = config
        self.pools = pools
        self.counters = counters
        self.fetcher = fetcher
        self._down = down
        self._rows_of = rows_of
        self.timeout_s = config.remote_timeout_ms / 1000
        self._ids = itertools.count(1)
        # (pool, key) -> the fetch that probes it: lookups stopping there wait.
        self._probing: dict[tuple[str, bytes], Fetch] = {}
        self._fetches: dict[int, Fetch] = {}
        self._misses: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._waiting: OrderedDict[int, Fetch] = OrderedDict()  # probes not sent yet
        self._sent = 0  # probes on the fetch thread, their answer not in yet

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
        if self._down():
            self.counters["remote.skipped_down"] += 1
            return hits
        if pool.resetting:
            return hits
        if len(self._waiting) >= MAX_WAITING_PROBES:
            self._send_probes(now)  # drops the probes given up meanwhile
            if len(self._waiting) >= MAX_WAITING_PROBES:
                self.counters["remote.probes_refused"] += 1
                return hits
        # One lookup's fetch: at most remote_fetch_max_bytes, and a quarter of
        # the pool (it may evict that much).
        row = pool.geometry.row_bytes
        limit = min(self.config.remote_fetch_max_bytes // row, pool.geometry.num_blocks // 4)
        wanted = list(keys[hits : hits + max(1, min(limit, MAX_PROBE_KEYS))])
        fetch = Fetch(next(self._ids), pool.name, pool.generation, row, pool.fingerprint,
                      wanted, now + self.timeout_s, leading=list(keys[:hits]))  # fmt: skip
        self._fetches[fetch.fetch_id] = fetch
        for k in wanted:
            self._probing.setdefault((pool.name, k), fetch)
        self._waiting[fetch.fetch_id] = fetch
        self._send_probes(now)
        return None

    def _send_probes(self, now: float) -> None:
        """Hands waiting probes to the fetch thread, oldest first, while fewer than
        PROBES_AT_ONCE are there; a probe whose lookup gave up is dropped."""
        waiting = self._waiting
        while waiting:
            fetch = next(iter(waiting.values()))
            if fetch.stood and now < fetch.deadline:
                if self._sent >= PROBES_AT_ONCE:
                    return
                self._sent += 1
                self.counters["remote.probes"] += 1
                self.fetcher.submit(functools.partial(self._probe, fetch=fetch))
            elif fetch.stood:
                self._give_up(fetch)  # off `waiting` too
                continue
            waiting.pop(fetch.fetch_id, None)

    def _probe(self, store: RemoteStore, *, fetch: Fetch) -> Callable[[], None]:
        """On the fetch thread: which of the fetch's keys the store has; nothing
        is sent for a fetch whose lookup gave up while it waited for the thread."""
        if not fetch.standing() or time.monotonic() >= fetch.deadline:
            return lambda: self._probe_done(fetch, None, "")
        try:
            prefix = self.config.remote_prefix
            present = store.exists([remote_key(prefix, fetch.fingerprint, k) for k in fetch.keys])
        except Exception as exc:  # RemoteError, or a bug: the loop part always runs
            reason = str(exc) if isinstance(exc, RemoteError) else repr(exc)
            return lambda: self._probe_done(fetch, None, reason)
        return lambda: self._probe_done(fetch, present, "")

    def _probe_done(self, fetch: Fetch, present: list[bool] | None, reason: str) -> None:
        """A probe's answer (None: not sent, or failed: `reason`), on the loop."""
        self._sent -= 1
        now = time.monotonic()
        if present is not None:
            self._probed(fetch, present, now)
        elif reason:
            self._probe_failed(fetch, reason)
        elif fetch.stood:  # skipped on the thread, past its deadline: given up
            self._give_up(fetch)
        self._send_probes(now)

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

    def _probed(self, fetch: Fetch, present: list[bool], now: float) -> None:
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
        if pool.resetting:
            del self._fetches[fetch.fetch_id]
            return
        # The lookup's own leading hits are the last to go for the fetch's room.
        pool.index.touch(fetch.leading)
        out = None
        while n and out is None:  # what fits, if not the whole run
            out = pool.owned.prepare_store(fetch.owner, fetch.keys[:n])
            n //= 2
        if out is None or not out.keys_to_store:
            if out is None:
                self.counters["remote.no_room"] += 1
                self._miss(fetch.pool, fetch.keys[0], now)
            del self._fetches[fetch.fetch_id]
            return
        fetch.keys, fetch.slots = list(out.keys_to_store), list(out.store_spec.slots)
        fetch.rows = self._rows_of(pool)
        fetch.deadline = now + self.timeout_s
        fetch.queued_at = now
        self.fetcher.submit(functools.partial(self._get, fetch=fetch))

    def _get(self, store: RemoteStore, *, fetch: Fetch) -> Callable[[], None]:
        """On the fetch thread: the fetch's values, a pipelined chunk at a time,
        checked and copied into their slots. Stops once the loop gave it up."""
        row_bytes, prefix = fetch.row_bytes, self.config.remote_prefix
        per_chunk = max(1, CHUNK_BYTES // row_bytes)
        bad = nbytes = 0
        error = ""
        fetch.progress = time.monotonic()  # started: the no-progress clock runs
        try:
            assert fetch.rows is not None
            rows = fetch.rows.view()
            for start in range(0, len(fetch.keys), per_chunk):
                if not fetch.standing():
                    break
                keys = fetch.keys[start : start + per_chunk]
                slots = fetch.slots[start : start + per_chunk]
                values = store.get([remote_key(prefix, fetch.fingerprint, k) for k in keys])
                for key, slot, value in zip(keys, slots, values, strict=True):
                    if value is None:
                        continue  # gone since the probe (expired or evicted there)
                    nbytes += len(value)
                    offset = slot * row_bytes
                    with fetch.lock:  # copied and checked in one pass, into its own slot
                        if not fetch.standing():
                            break
                        try:
                            copy_value(rows[offset : offset + row_bytes], value, key, row_bytes)
                        except BadValue as exc:
                            bad += 1
                            log.info("event=remote_value_refused pool=%s key=%s reason=%s",
                                     fetch.pool, key.hex(), exc)  # fmt: skip
                            continue
                        fetch.copied.append(key)
                        fetch.progress = time.monotonic()
        except Exception as exc:  # RemoteError, or a bug: the loop part always runs
            error = str(exc) if isinstance(exc, RemoteError) else repr(exc)
        return lambda: self._fetched(fetch, bad, nbytes, error)

    def _fetched(self, fetch: Fetch, bad: int, nbytes: int, error: str) -> None:
        self.counters["remote.bad_values"] += bad
        self.counters["remote.bytes_read"] += nbytes
        if error:
            self.counters["remote.errors"] += 1
            log.debug("event=remote_fetch_failed pool=%s reason=%s", fetch.pool, error)
        if fetch.stood:
            self._settle(fetch)

    def _give_up(self, fetch: Fetch) -> None:
        """The loop stops waiting for `fetch`: after this the thread copies nothing."""
        with fetch.lock:
            fetch.stood = False
        self.counters["remote.timeouts"] += 1
        self._unprobe(fetch)
        if fetch.slots:
            self._settle(fetch)
        else:  # its probe had no answer in time: its keys are not probed again soon
            self._fetches.pop(fetch.fetch_id, None)
            self._waiting.pop(fetch.fetch_id, None)
            self._miss(fetch.pool, fetch.keys[0], time.monotonic())

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
        complete_fetch(pool, fetch.owner, copied, failed, "remote")  # never written back
        self.counters["remote.hits"] += len(copied)
        self.counters["remote.fetch_failures"] += len(failed)

    def expire(self, now: float) -> None:
        """Gives up the fetches that made no progress within the timeout."""
        for fetch in list(self._fetches.values()):
            if fetch.slots and not fetch.progress:  # its GETs wait behind another fetch's
                due = fetch.queued_at + QUEUED_TIMEOUTS * self.timeout_s
            else:  # probing, or getting: no answer, no byte for a timeout
                due = max(fetch.deadline, fetch.progress + self.timeout_s)
            if now >= due:
                self._give_up(fetch)

    def stop(self) -> None:
        """The daemon stops: the thread copies nothing more."""
        for fetch in list(self._fetches.values()):
            with fetch.lock:
                fetch.stood = False
