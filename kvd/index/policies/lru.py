"""Runs in the daemon (pure core): least-recently-used eviction, one ordered map."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator

from kvd.index.policies.base import CachePolicy, Key, KeyPredicate


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self, capacity: int, is_ready: KeyPredicate, is_evictable: KeyPredicate) -> None:
        super().__init__(capacity, is_ready, is_evictable)
        # Oldest first: the head is the next victim.
        self._order: OrderedDict[Key, None] = OrderedDict()

    def get(self, key: Key) -> bool:
        return key in self._order

    def insert(self, key: Key) -> None:
        self._order[key] = None

    def remove(self, key: Key) -> None:
        del self._order[key]

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        victims: list[Key] = []
        candidates = iter(self._order)
        while len(victims) < n:
            key = self._first_victim(candidates, protected)
            if key is None:
                return None
            victims.append(key)
        for key in victims:
            del self._order[key]
        return victims

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def keys(self) -> Iterator[Key]:
        return iter(self._order)
