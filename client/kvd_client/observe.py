"""Runs in the engine's scheduler process: lookups the ready table answered, reported to the daemon.

A lookup answered from the pool's ready table (SPEC section 15) sends no
message, but the daemon's admission policy and lookup counters must still
learn of it. `LookupReports` queues each one and a thread of its own sends
them in batches (`Observe`, at most `MAX_OBSERVED_LOOKUPS` lookups and
`MAX_KEYS_PER_REQUEST` keys a message, posted without waiting for the
reply): `OBSERVE_EVERY_S` after the first one queued, or at once when
`OBSERVE_BATCH` wait. With none queued the thread sleeps: in an engine's
process a thread that wakes every few ms takes the GIL from the engine's
step (on a 2-core host that cost a decode step about a tenth, `kvd bench
peers`). The engine's thread flushes too, before any other request of the
session, so the daemon learns of lookups in the order they were made.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from kvd_client import protocol as p

OBSERVE_BATCH = 64  # lookups answered from the table, reported in one message
OBSERVE_EVERY_S = 0.005  # ... or at the first lookup this long after the last report
Post = Callable[[list[list[bytes]], list[int]], bool]  # sends one Observe; True if sent


class LookupReports:
    def __init__(self, post: Post) -> None:
        self._post = post
        # Lookups not reported yet, as (keys, hits).
        self._queue: collections.deque[tuple[list[bytes], int]] = collections.deque()
        # Held while one thread drains the queue and posts it (the reporter and the
        # engine's thread both flush): no IndexError, and batches go in order.
        self._flush_lock = threading.Lock()
        self._queued = threading.Event()  # set by a lookup queued
        self._full = threading.Event()  # set when OBSERVE_BATCH are queued
        self._stopping = threading.Event()
        self.thread: threading.Thread | None = None  # started at the first lookup

    def __bool__(self) -> bool:
        """Whether lookups wait to be reported."""
        return bool(self._queue)

    def add(self, keys: list[bytes], hits: int | None) -> None:
        """Queues a table lookup for the reporter thread."""
        if len(keys) > p.MAX_KEYS_PER_REQUEST:  # what one Observe may carry; the rest goes
            keys = keys[: p.MAX_KEYS_PER_REQUEST]
            hits = min(hits or 0, p.MAX_KEYS_PER_REQUEST)
        self._queue.append((keys, hits or 0))
        if self.thread is None:
            self.thread = threading.Thread(target=self._report, name="kvd-observe", daemon=True)
            self.thread.start()
        self._queued.set()
        if len(self._queue) >= OBSERVE_BATCH:
            self._full.set()

    def _report(self) -> None:
        while not self._stopping.is_set():
            self._queued.wait()  # no wake-ups while nothing is queued
            if self._stopping.is_set():
                return
            self._full.wait(OBSERVE_EVERY_S)  # more lookups of the same step join
            # Cleared before draining: a lookup queued after the drain sets it again.
            self._queued.clear()
            self._full.clear()
            self.flush()

    def flush(self) -> int:
        """Sends the lookups not reported yet; not waited for (the daemon has them
        once it has read them). Returns how many were sent."""
        sent = 0
        with self._flush_lock:
            while self._queue:
                batch: list[tuple[list[bytes], int]] = []
                num_keys = 0  # at most MAX_KEYS_PER_REQUEST keys per frame, as the daemon wants
                while self._queue and len(batch) < p.MAX_OBSERVED_LOOKUPS:
                    if batch and num_keys + len(self._queue[0][0]) > p.MAX_KEYS_PER_REQUEST:
                        break
                    keys, hits = self._queue.popleft()
                    batch.append((keys, hits))
                    num_keys += len(keys)
                if self._post([k for k, _ in batch], [h for _, h in batch]):
                    sent += len(batch)
        return sent

    def stop(self) -> None:
        """Stops the reporter thread (what is still queued stays: `flush` it)."""
        if self.thread is not None:
            self._stopping.set()
            self._queued.set()
            self._full.set()
            self.thread.join(timeout=5)
