"""Runs in the daemon (pure core): a probation segment and a main segment, with two knobs.

The rules of the adaptive policy, for one fixed behaviour (alpha, memory);
`AdaptivePolicy` (`kvd.core.index.policies.adaptive`) picks the behaviour online
with miniature copies of this very class, so they follow the same code.

    new block, key not seen lately  -> P  probation: LRU slot -> ... -> MRU slot
    new block, key in the doorkeeper -> M  main:      LRU slot -> ... -> MRU slot
    hit on a ready P block            -> M  (a second sighting: the block is proven)
    victim (from P or M)              -> its fingerprint joins the doorkeepers

    stamp  [slot] = the clock at its insert or last touch (the clock counts blocks)
    fp     [slot] = the 32-bit fingerprint of its key, for the doorkeepers
    doorkeepers {memory h: Doorkeeper}: each remembers the last h/2 to h
           capacities of victims; `memory` picks the one that admits

The victim is P's oldest evictable block when it has waited at least `alpha`
times as long as M's oldest one, else M's:

    now - stamp[P head] >= alpha * (now - stamp[M head])  ->  evict the P head

so alpha = 1 is exactly LRU over both segments, and alpha = 0 evicts every
unproven block before any proven one: the plain admission filter that
admits on a second sighting (a block seen once lives until the next
eviction; S3-FIFO with a tiny small queue, Yang et al., SOSP '23; the
doorkeeper and window of W-TinyLFU, Einziger, Friedman & Manes, ACM ToS
2017; vLLM's store threshold). In between, a block seen once lives alpha
times as long as a proven one, as with the insertion positions of DIP/BIP
(Qureshi et al., ISCA '07). A short memory makes the filter a frequency
filter (seen twice within a capacity or so); a long one admits any block
that comes back within a few.

Prefix awareness: the keys of a store batch come in prefix order (keys[i] is
the parent of keys[i + 1]), so a batch is inserted tail first, its deepest
block the oldest. With the index's touch (the first key ends most recent),
the tail of a chain goes before its head, whose loss would make the whole
rest useless under leading-prefix hits.

Memory per slot: the lists 9 bytes, the stamp 8 (array('q'), never wraps),
the fingerprint 4, and a doorkeeper of memory h 8h to 16h bytes (two tables
of 4-byte cells, a power of two of them, at most half full): with (SHORT,
LONG) 61 to 101 bytes, 67 at 1,000,000 slots (tracemalloc).
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from itertools import pairwise

from kvd.core.index.policies.arrays import filled
from kvd.core.index.policies.base import CachePolicy, Key, SlotPredicate
from kvd.core.index.policies.doorkeeper import Doorkeeper
from kvd.core.index.policies.slot_lists import SlotLists

P, M = 0, 1  # probation and main, lists of `_lists`
SHORT, LONG = 1, 4  # memories: a doorkeeper of memory h remembers h/2 to h capacities of victims


def always(slot: int) -> bool:
    """The predicate of blocks that are always ready and evictable (the miniatures'):
    a `ProbationCache` given it skips the checks."""
    return True


def fingerprint(key: Key) -> int:
    """The 32-bit fingerprint of a key: deterministic across processes (unlike `hash`),
    so the miniatures sample the same keys on every run."""
    return zlib.crc32(key)


class ProbationCache(CachePolicy):
    """Probation and main segments with a fixed age ratio `alpha` in [0, 1] (see the module doc)."""

    name = "probation"

    def __init__(
        self,
        capacity: int,
        is_ready: SlotPredicate,
        is_evictable: SlotPredicate,
        alpha: float = 1.0,
        memory: int = LONG,
        memories: Sequence[int] = (LONG,),
    ) -> None:
        super().__init__(capacity, is_ready, is_evictable)
        self.alpha = alpha
        self.memory = memory
        self._lists = SlotLists(capacity, 2)
        self._stamp = filled("q", capacity)
        self._fp = filled("I", capacity)
        # Every victim is remembered by each doorkeeper; `memory` picks the one
        # that admits, so the policy can change its memory at once.
        self._doorkeepers = {h: Doorkeeper(h * capacity // 2) for h in memories}
        self._clock = 0

    # -- the interface ----------------------------------------------------------

    def get(self, slot: int) -> bool:
        return self._lists.list_of(slot) >= 0

    def insert(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self.insert_fingerprints(slots, list(map(zlib.crc32, keys)))

    def adopt(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        # `insert` links a batch tail first (its first block ends most recent):
        # the newest block goes first so that it ends the most recent.
        self.insert(list(slots)[::-1], list(keys)[::-1])

    def insert_fingerprints(self, slots: Sequence[int], fps: Sequence[int]) -> None:
        """`insert`, for keys already reduced to their `fingerprint`."""
        stamp, fp_of, seen = self._stamp, self._fp, self._doorkeepers[self.memory]
        to_p: list[int] = []
        to_m: list[int] = []
        clock = self._clock
        if not len(seen):  # it remembers nothing (a new policy; a warm restart): all on P
            tail_first = list(slots)[::-1]
            for slot, fp in zip(tail_first, list(fps)[::-1], strict=True):
                fp_of[slot] = fp
            for c, slot in enumerate(tail_first, clock + 1):
                stamp[slot] = c
            self._clock = clock + len(tail_first)
            self._lists.append(P, tail_first)
            return
        for i in range(len(slots) - 1, -1, -1):  # tail first
            slot, fp = slots[i], fps[i]
            fp_of[slot] = fp
            clock += 1
            stamp[slot] = clock
            (to_m if seen.knows(fp) else to_p).append(slot)
        self._clock = clock
        self._lists.append(P, to_p)
        self._lists.append(M, to_m)

    def remove(self, slots: Iterable[int]) -> None:
        self._lists.unlink(slots)

    def touch(self, slots: Iterable[int]) -> None:
        # A hit proves a block, except one still being stored (as in ARC).
        # Stamps follow the order of the batch, so both lists stay sorted.
        lists, stamp, is_ready = self._lists, self._stamp, self._is_ready
        stay: list[int] = []
        promote: list[int] = []
        clock = self._clock
        for slot in slots:
            clock += 1
            stamp[slot] = clock
            if lists.list_of(slot) == P and not is_ready(slot):
                stay.append(slot)
            else:
                promote.append(slot)
        self._clock = clock
        if stay:
            lists.move_to_end(P, stay)
        lists.move_to_end(M, promote)

    def touch_ready(self, slots: Sequence[int]) -> None:
        """`touch`, for slots known to be ready (the miniatures' blocks): all go to M."""
        stamp, clock = self._stamp, self._clock
        for slot in slots:
            clock += 1
            stamp[slot] = clock
        self._clock = clock
        self._lists.move_to_end(M, slots)

    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        if n <= 0:
            return []
        is_evictable, lists = self._is_evictable, self._lists
        p_walk: Iterator[int]
        m_walk: Iterator[int]
        if is_evictable is not always:
            p_walk, m_walk = (
                (s for s in lists.walk(lst) if s not in protected and is_evictable(s))
                for lst in (P, M)
            )
        elif protected:
            p_walk, m_walk = ((s for s in lists.walk(lst) if s not in protected) for lst in (P, M))
        else:
            p_walk, m_walk = lists.walk(P), lists.walk(M)
        victims = self._merge(p_walk, m_walk, n)
        if len(victims) < n:
            return None
        self._lists.unlink(victims)
        fp_of = self._fp
        fps = [fp_of[slot] for slot in victims]
        for doorkeeper in self._doorkeepers.values():
            doorkeeper.add(fps)
        return victims

    def clear(self) -> None:
        self._lists.clear()
        for doorkeeper in self._doorkeepers.values():
            doorkeeper.clear()
        self._clock = 0

    def __len__(self) -> int:
        return len(self._lists)

    def slots(self) -> Iterator[int]:
        """Every resident slot: P oldest first, then M oldest first (as ARC lists T1, T2),
        an order that alpha, and so a lookup, never changes."""
        yield from self._lists.walk(P)
        yield from self._lists.walk(M)

    def check_invariants(self) -> list[str]:
        problems = self._lists.check()
        for doorkeeper in self._doorkeepers.values():
            problems.extend(doorkeeper.check())
        if self.memory not in self._doorkeepers:
            problems.append(f"memory {self.memory} has no doorkeeper")
        for lst, label in ((P, "probation"), (M, "main")):
            stamps = [self._stamp[slot] for slot in self._lists.walk(lst)]
            if any(a > b for a, b in pairwise(stamps)):
                problems.append(f"{label} is not in stamp order")
            if stamps and stamps[-1] > self._clock:
                problems.append(f"{label} holds a stamp {stamps[-1]} after the clock {self._clock}")
        if not 0.0 <= self.alpha <= 1.0:
            problems.append(f"alpha {self.alpha} outside [0, 1]")
        return problems

    # -- the rule ----------------------------------------------------------------

    def _merge(self, p_walk: Iterator[int], m_walk: Iterator[int], n: int) -> list[int]:
        """Up to `n` slots from the two walks, in victim order: the P head while it
        has waited `alpha` times as long as the M head, else the M head. Each walk
        is advanced only past the slots taken (O(n + slots the walks skip))."""
        victims: list[int] = []
        stamp, alpha = self._stamp, self.alpha
        now = self._clock + 1  # ages >= 1
        head_p = next(p_walk, None)
        head_m = next(m_walk, None)
        while len(victims) < n:
            if head_p is not None and (
                head_m is None or now - stamp[head_p] >= alpha * (now - stamp[head_m])
            ):
                victims.append(head_p)
                head_p = next(p_walk, None)
            elif head_m is not None:
                victims.append(head_m)
                head_m = next(m_walk, None)
            else:
                break
        return victims

    # -- read-only views, for tests and stats ------------------------------------

    @property
    def sizes(self) -> tuple[int, int]:
        """|P|, |M|."""
        p, m = self._lists.sizes
        return p, m

    @property
    def fingerprints(self) -> array[int]:
        """The fingerprint of the key in each slot (stale for slots not resident). Read only."""
        return self._fp

    def in_main(self, slot: int) -> bool:
        return self._lists.list_of(slot) == M

    def remembers(self, key: Key) -> bool:
        """True when `key` was evicted lately: stored again, it goes straight to M."""
        return fingerprint(key) in self._doorkeepers[self.memory]
