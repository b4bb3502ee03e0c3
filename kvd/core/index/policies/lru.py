"""Runs in the daemon (pure core): least-recently-used eviction, one list of slots.

    SlotLists(capacity, 1):  sentinel -> LRU slot (next victim) -> ... -> MRU slot -> sentinel

Inserting or touching a slot moves it to the MRU end; eviction walks from
the LRU end, skipping blocks that are not evictable or are protected.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

from kvd.core.index.policies.base import CachePolicy, Key, SlotPredicate
from kvd.core.index.policies.slot_lists import SlotLists

_ORDER = 0  # the one list


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self, capacity: int, is_ready: SlotPredicate, is_evictable: SlotPredicate) -> None:
        super().__init__(capacity, is_ready, is_evictable)
        self._order = SlotLists(capacity, 1)

    def get(self, slot: int) -> bool:
        return self._order.list_of(slot) == _ORDER

    def insert(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self._order.append(_ORDER, slots)

    def remove(self, slots: Iterable[int]) -> None:
        self._order.unlink(slots)

    def touch(self, slots: Iterable[int]) -> None:
        self._order.move_to_end(_ORDER, slots)

    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        victims = self._victims(self._order.walk(_ORDER), protected, n)
        if len(victims) < n:
            return None
        self._order.unlink(victims)
        return victims

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return self._order.sizes[_ORDER]

    def slots(self) -> Iterator[int]:
        return self._order.walk(_ORDER)

    def check_invariants(self) -> list[str]:
        return self._order.check()
