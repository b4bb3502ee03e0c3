"""Runs in the daemon (pure core): the interface every eviction policy implements.

A policy decides order and victims only. It may *read* whether a block is ready
or evictable through the two callbacks it is given, but it never changes
reference counts, states or slots: those belong to `BlockIndex`.

A policy works on slot ids, not keys: the index numbers its slots
`0..capacity-1` and hands each new block's slot (and key) to `insert`, so a
policy can keep its order in flat arrays indexed by slot (see `SlotLists`)
instead of one dict entry and one node object per key. The verbs take a
batch of slots, as the index gets them, so a policy written in Python pays
one call per batch, not per block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

Key = bytes
SlotPredicate = Callable[[int], bool]


class CachePolicy(ABC):
    """Orders the resident blocks of one pool, by slot id, and picks eviction victims.

    `capacity` is the number of slots of the pool; slot ids are
    `0..capacity-1`. `is_ready(slot)` tells whether a resident block has
    finished storing and `is_evictable(slot)` whether it is ready and unpinned.
    Both are only ever asked about resident slots, and both only read.

    A slot is resident from `insert` until `evict` picks it or `remove` drops
    it; the index then frees the slot and may `insert` it again for another
    key. Calls that break these rules (inserting a resident slot, touching or
    removing one that is not) are index bugs: they are not checked on the hot
    path, and `check_invariants` reports the damage.
    """

    name: str = ""

    def __init__(self, capacity: int, is_ready: SlotPredicate, is_evictable: SlotPredicate) -> None:
        self.capacity = capacity
        self._is_ready = is_ready
        self._is_evictable = is_evictable

    @abstractmethod
    def get(self, slot: int) -> bool:
        """True when `slot` is resident. Mutates nothing."""

    def adopt(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        """Makes each of `slots` resident with a ready block of an earlier run (a
        warm restart, SPEC 13), oldest store first, so that the last ends the
        most recent. By default `insert` in that order. Adopting consecutive
        slices, in order, must leave the policy as adopting them all at once
        (`AdoptingPolicy` relies on it)."""
        self.insert(slots, keys)

    @abstractmethod
    def insert(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        """Makes each of `slots` resident, holding a new block (not ready yet)
        for the key at the same position; in order, so the last is the newest.

        The slots must not be resident. The keys are for history only (ghost
        lists, admission counters): a policy may remember them as
        fingerprints, which is how it recognises a key that comes back. May
        update history but never evicts: room was made by `evict`.
        """

    @abstractmethod
    def remove(self, slots: Iterable[int]) -> None:
        """Drops resident slots without keeping history (failed stores)."""

    @abstractmethod
    def touch(self, slots: Iterable[int]) -> None:
        """Marks resident slots as just used, in order: the last one ends most recent.

        The index passes only resident slots (it skips absent keys).
        """

    @abstractmethod
    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        """Picks and drops `n` victims among evictable resident slots not in `protected`.

        Returns the victims' slots, which are no longer resident. Atomic:
        returns `None` and changes nothing when fewer than `n` such slots
        exist. `evict(0, ...)` is always safe and returns `[]`. Costs
        O(victims + slots skipped), never a rescan from the head per victim.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forgets every slot, resident or historical (the index's `reset`)."""

    @abstractmethod
    def __len__(self) -> int:
        """The number of resident slots."""

    @abstractmethod
    def slots(self) -> Iterator[int]:
        """Every resident slot, in the policy's own order (LRU: the next victim first)."""

    @abstractmethod
    def check_invariants(self) -> list[str]:
        """The policy's own structural problems (empty when none). O(capacity); for tests."""

    def record_lookup(self, keys: Sequence[Key]) -> None:  # noqa: B027 - optional hook
        """Sees the keys of a `lookup` (admission signal). Default: ignores them."""

    def settle(self) -> bool:
        """One step of work kept off the latency path (the daemon calls it when idle);
        True while more remains. Default: none."""
        return False

    def has_idle_work(self) -> bool:
        """Whether `settle` has anything to do."""
        return False

    def _victims(self, candidates: Iterator[int], protected: Collection[int], n: int) -> list[int]:
        """The next (up to) `n` slots of `candidates` that may be evicted, in order;
        the iterator stops right after the last one, so a later call resumes there."""
        victims: list[int] = []
        if n <= 0:
            return victims
        is_evictable = self._is_evictable
        for slot in candidates:
            if slot not in protected and is_evictable(slot):
                victims.append(slot)
                if len(victims) == n:
                    break
        return victims
