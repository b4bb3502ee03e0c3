"""Runs in the daemon (pure core): Adaptive Replacement Cache (Megiddo & Modha, FAST '03).

    resident  T1: seen once (recency)     T2: seen again while ready (frequency)
    ghosts    B1: evicted from T1         B2: evicted from T2
    target p: the share of the cache ARC wants for T1; a ghost hit in B1 grows
              it, a ghost hit in B2 shrinks it.

Departures from the paper, all forced by blocks that are not ready or pinned:
a block still being stored stays in T1 (only a hit on a *ready* T1 block
promotes it); a ghost hit adapts p on insert, and the new block starts in T1;
when the list ARC prefers has no evictable block, the victim comes from the
other list rather than failing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator

from kvd.index.policies.base import CachePolicy, Key, KeyPredicate


class ARCPolicy(CachePolicy):
    name = "arc"

    def __init__(self, capacity: int, is_ready: KeyPredicate, is_evictable: KeyPredicate) -> None:
        super().__init__(capacity, is_ready, is_evictable)
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self.target_t1 = 0.0

    def get(self, key: Key) -> bool:
        return key in self._t1 or key in self._t2

    def insert(self, key: Key) -> None:
        if key in self._b1:
            delta = max(1.0, len(self._b2) / len(self._b1))
            self.target_t1 = min(float(self.capacity), self.target_t1 + delta)
            del self._b1[key]
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / len(self._b2))
            self.target_t1 = max(0.0, self.target_t1 - delta)
            del self._b2[key]
        self._t1[key] = None
        self._trim_ghosts()

    def remove(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def touch(self, key: Key) -> None:
        if key in self._t1:
            if self._is_ready(key):
                del self._t1[key]
                self._t2[key] = None
            else:
                self._t1.move_to_end(key)
        else:
            self._t2.move_to_end(key)

    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        # Walk both lists lazily from their LRU ends, choosing per victim the
        # list ARC prefers given the T1 size left after the victims so far.
        from_t1: list[Key] = []
        from_t2: list[Key] = []
        t1_iter, t2_iter = iter(self._t1), iter(self._t2)
        t1_left = len(self._t1)
        t1_done = t2_done = False
        while len(from_t1) + len(from_t2) < n:
            prefer_t1 = t1_left > 0 and (t1_left > self.target_t1 or t2_done)
            key: Key | None = None
            if prefer_t1 and not t1_done:
                key = self._first_victim(t1_iter, protected)
                t1_done = key is None
            if key is None and not t2_done:
                key = self._first_victim(t2_iter, protected)
                t2_done = key is None
                if key is not None:
                    from_t2.append(key)
                    continue
            if key is None and not t1_done:
                key = self._first_victim(t1_iter, protected)
                t1_done = key is None
            if key is None:
                return None
            from_t1.append(key)
            t1_left -= 1
        for key in from_t1:
            del self._t1[key]
            self._b1[key] = None
        for key in from_t2:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()
        return from_t1 + from_t2

    def _trim_ghosts(self) -> None:
        # The paper's bounds: |T1| + |B1| <= c and all four lists <= 2c.
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            ghosts = self._b2 if self._b2 else self._b1
            if not ghosts:
                break
            ghosts.popitem(last=False)

    def clear(self) -> None:
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.clear()
        self.target_t1 = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def keys(self) -> Iterator[Key]:
        yield from self._t1
        yield from self._t2

    # Read-only views for tests and stats.
    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return len(self._t1), len(self._t2), len(self._b1), len(self._b2)

    def in_t2(self, key: Key) -> bool:
        return key in self._t2
