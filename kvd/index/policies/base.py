"""Runs in the daemon (pure core): the interface every eviction policy implements.

A policy decides order and victims only. It may *read* whether a block is ready
or evictable through the two callbacks it is given, but it never changes
reference counts, states or slots: those belong to `BlockIndex`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Sequence

Key = bytes
KeyPredicate = Callable[[Key], bool]


class CachePolicy(ABC):
    """Orders the resident keys of one pool and picks eviction victims.

    `capacity` is the number of slots of the pool; `is_ready(key)` tells
    whether a resident block has finished storing and `is_evictable(key)`
    whether it is ready and unpinned. Both are only ever asked about resident
    keys.
    """

    name: str = ""

    def __init__(self, capacity: int, is_ready: KeyPredicate, is_evictable: KeyPredicate) -> None:
        self.capacity = capacity
        self._is_ready = is_ready
        self._is_evictable = is_evictable

    @abstractmethod
    def get(self, key: Key) -> bool:
        """True when `key` is resident. Mutates nothing."""

    @abstractmethod
    def insert(self, key: Key) -> None:
        """Makes a new key resident (its block is not ready yet).

        The key must not be resident. May update history (ghost lists,
        admission counters) but never evicts: room was made by `evict`.
        """

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Drops a resident key without keeping history (failed store, reset).

        The key must be resident.
        """

    @abstractmethod
    def touch(self, key: Key) -> None:
        """Marks a resident key as just used. Absent keys are the caller's problem."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[Key]) -> list[Key] | None:
        """Picks and drops `n` victims among evictable, unprotected resident keys.

        Atomic: returns `None` and changes nothing when fewer than `n` such
        keys exist. `evict(0, ...)` is always safe and returns `[]`. Costs
        O(victims + keys skipped), never a rescan from the head per victim.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forgets every key, resident or historical."""

    @abstractmethod
    def __len__(self) -> int:
        """The number of resident keys."""

    @abstractmethod
    def keys(self) -> Iterator[Key]:
        """Every resident key, in no promised order."""

    def record_lookup(self, keys: Sequence[Key]) -> None:  # noqa: B027 - optional hook
        """Sees the keys of a `lookup` (admission signal). Default: ignores them."""

    def _first_victim(self, candidates: Iterator[Key], protected: Collection[Key]) -> Key | None:
        """The next key of `candidates` that may be evicted, or None when exhausted."""
        for key in candidates:
            if key not in protected and self._is_evictable(key):
                return key
        return None
