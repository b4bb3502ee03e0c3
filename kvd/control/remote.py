"""Runs in the daemon: the remote tier on the event loop, its two threads and its upkeep (SPEC 14).

`RemoteTier` puts together the read-through (`kvd.control.read_through`) and
the write-behind (`kvd.control.write_behind`), each with a thread of its own
(`kvd.io.remote_store.RemoteThread`, one connection each), so the loop never
waits on the remote tier. Every step on an index happens on the loop; the
threads only call the store and copy bytes. `tick` gives up stalled
fetches, pings the tier (when it is down, to reconnect; when it is idle,
every second, so that its state is true), maps each new pool's rows on the
write thread ahead of use, and lets a dropped pool's mapping go.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvd.config import Config, parse_remote_url
from kvd.control.read_through import ReadThrough
from kvd.control.write_behind import WriteBehind
from kvd.io.remote_store import Link, RemoteStore, RemoteThread
from kvd.io.remote_value import NATIVE_CRC

if TYPE_CHECKING:
    from kvd.control.pools import Pool, PoolRegistry
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.remote")
HEALTH_EVERY_S = 1.0  # an idle tier is pinged this often, for its state


class RemoteTier:
    def __init__(
        self,
        config: Config,
        pools: PoolRegistry,
        counters: Counter[str],
        fetcher: RemoteThread,
        writer: RemoteThread,
        link: Link,
    ) -> None:
        self.config = config
        self.pools = pools
        self.counters = counters
        self.fetcher = fetcher
        self.writer = writer
        self.link = link
        self._rows: dict[tuple[str, int], Rows] = {}
        self._pinging = False
        self._pinged_at = 0.0
        self.read = ReadThrough(config, pools, counters, fetcher, self.is_down, self._rows_of)
        self.write = WriteBehind(config, pools, counters, writer, self.is_down, self._rows_of)

    @classmethod
    def start(
        cls,
        config: Config,
        pools: PoolRegistry,
        counters: Counter[str],
        post: Callable[[Callable[[], None]], object],
    ) -> RemoteTier:
        """The tier of `config.remote_url`, its threads started; `post` hands a
        thread's result to the loop (its call_soon_threadsafe)."""
        target = parse_remote_url(config.remote_url)
        where = ",".join(f"{h}:{p}" for h, p in target.nodes)  # never the credentials
        link = Link(where)
        timeout_s = config.remote_timeout_ms / 1000
        # One fetch thread: a second one, on its own connection, fetched slower
        # here (2 cores; the threads share the GIL for hiredis's parsing).
        fetcher, writer = (
            RemoteThread(f"kvd-remote-{role}", RemoteStore(target, timeout_s, link), post)
            for role in ("fetch", "write")
        )
        log.info(
            "event=remote_tier remote=%s cluster=%s tls=%s timeout_ms=%d write_max_bytes=%d "
            "native_crc=%s",
            where, target.cluster, target.tls, config.remote_timeout_ms,
            config.remote_write_max_bytes, NATIVE_CRC,
        )  # fmt: skip
        if not NATIVE_CRC:
            log.warning("event=remote_crc_slow reason=kvd_client._crc32c was not built")
        return cls(config, pools, counters, fetcher, writer, link)

    def is_down(self) -> bool:
        """The tier failed and has not come back (not merely: not connected yet)."""
        return not self.link.up and self.link.changes > 0

    def lookup(self, pool: Pool, keys: Sequence[bytes], hits: int, now: float) -> int | None:
        """A lookup that found `hits` leading local hits, then a miss (ReadThrough)."""
        return self.read.lookup(pool, keys, hits, now)

    def write_ready(self, pool: Pool, keys: list[bytes]) -> None:
        """Starts the writes of blocks of `pool` that became ready (engines' stores)."""
        self.write.write(pool, keys)

    # -- upkeep (loop) ---------------------------------------------------------

    def tick(self, now: float) -> None:
        self.read.expire(now)
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
        self.counters["remote.write_bytes_in_flight"] = self.write.write_bytes

    @staticmethod
    def _mapped(rows: Rows, store: RemoteStore) -> Callable[[], None]:
        try:
            rows.view()
        except Exception as exc:  # the pool was dropped first: nothing to map
            log.debug("event=remote_map_skipped shm=%s reason=%r", rows.name, exc)
        return lambda: None

    def _ping(self, store: RemoteStore) -> Callable[[], None]:
        try:
            store.ping()
        except Exception:  # down (logged by the link), or refused: counted by state
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
        self.read.stop()
        self.fetcher.close(1.0)
        self.writer.close(1.0)
