"""Runs in the daemon (pure core): Adaptive Replacement Cache (Megiddo & Modha, FAST '03).

    resident  T1: seen once (recency)     T2: seen again (frequency)
    ghosts    B1: evicted from T1         B2: evicted from T2
    target p: the share of the cache ARC wants for T1; a ghost hit in B1 grows
              it, a ghost hit in B2 shrinks it.

Layout: the resident lists are linked through slot ids, the ghosts are
fingerprints, so nothing here holds a key object:

    lists  SlotLists(c, 2)    T1: LRU slot -> ... -> MRU slot    (tag 1 per slot)
                              T2: LRU slot -> ... -> MRU slot    (tag 2 per slot)
    fp     [ hash(key of slot 0) ] ... [ slot c-1 ]   array('q'), for the ghost
                                                      a victim leaves behind
    ghosts GhostLists(2c, 2)  B1, B2: fingerprints, oldest first, hashed

Bounds, as in the paper: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c;
the oldest ghosts go first (of B1 for the first bound, of B2 if it has any,
else B1, for the second). So a pool of c blocks costs 17 bytes per block
for the resident lists and fingerprints, and 50 to 66 for room for 2c ghosts.

As in the paper, a key that comes back after a ghost hit (B1 or B2) starts in
T2, and a hit on a ready T1 block promotes it to T2. Departures, all forced
by blocks that are not ready or pinned, or by stores coming in batches:
a touch of a T1 block still being stored keeps it in T1 (moved to the MRU
end); a ghost hit adapts p when its key is inserted, after the eviction that
made room for the batch (the index evicts first, then inserts); when the list
ARC prefers has no evictable block, the victim comes from the other list
rather than failing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

from kvd.core.index.policies.arrays import filled
from kvd.core.index.policies.base import CachePolicy, Key, SlotPredicate
from kvd.core.index.policies.ghosts import GhostLists
from kvd.core.index.policies.slot_lists import SlotLists

T1, T2 = 0, 1  # resident lists of `_lists`
B1, B2 = 0, 1  # ghost lists of `_ghosts`


class ARCPolicy(CachePolicy):
    name = "arc"

    def __init__(self, capacity: int, is_ready: SlotPredicate, is_evictable: SlotPredicate) -> None:
        super().__init__(capacity, is_ready, is_evictable)
        self._lists = SlotLists(capacity, 2)
        self._fp = filled("q", capacity)
        # At most 2c - (resident blocks) ghosts: up to 2c once failed stores
        # have emptied the cache, so that many nodes, allocated once.
        self._ghosts = GhostLists(2 * capacity, 2)
        self.target_t1 = 0.0

    def get(self, slot: int) -> bool:
        return self._lists.list_of(slot) >= 0

    def insert(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        fp_of, ghosts, c = self._fp, self._ghosts, self.capacity
        b_sizes = ghosts.sizes
        t1, t2 = self._lists.sizes
        to_t1: list[int] = []
        to_t2: list[int] = []
        # As the paper takes requests, one key at a time, trimming the ghosts
        # after each; but the new slots join their lists after the loop (same
        # order; t1 and t2 count them meanwhile) and the trim waits for a
        # ghost hit or the end. Trimming once for a run of keys that miss drops
        # the same oldest ghosts as trimming after each: as T1 grows the
        # bounds only tighten (checked against the per-key rule in the tests).
        for slot, key in zip(slots, keys, strict=True):
            fp = hash(key)
            fp_of[slot] = fp
            if (b_sizes[B1] or b_sizes[B2]) and ghosts.find(fp) >= 0:
                self._trim_ghosts(t1, t2)  # the keys so far may drop this very ghost
                was = ghosts.take(fp)
                if was >= 0:
                    # The step uses the ghost list sizes from before the hit left its list.
                    if was == B1:
                        delta = max(1.0, b_sizes[B2] / (b_sizes[B1] + 1))
                        self.target_t1 = min(float(c), self.target_t1 + delta)
                    else:
                        delta = max(1.0, b_sizes[B1] / (b_sizes[B2] + 1))
                        self.target_t1 = max(0.0, self.target_t1 - delta)
                    to_t2.append(slot)
                    t2 += 1
                    continue
            to_t1.append(slot)
            t1 += 1
        self._trim_ghosts(t1, t2)
        self._lists.append(T1, to_t1)
        self._lists.append(T2, to_t2)

    def remove(self, slots: Iterable[int]) -> None:
        self._lists.unlink(slots)

    def touch(self, slots: Iterable[int]) -> None:
        # A hit promotes to T2, except on a T1 block still being stored. The
        # two moves touch different lists, so splitting the batch keeps the
        # order within each.
        lists, is_ready = self._lists, self._is_ready
        stay: list[int] = []
        promote: list[int] = []
        for slot in slots:
            if lists.list_of(slot) == T1 and not is_ready(slot):
                stay.append(slot)
            else:
                promote.append(slot)
        if stay:
            lists.move_to_end(T1, stay)
        lists.move_to_end(T2, promote)

    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        # ARC takes a victim from T1 while |T1| (less the T1 victims so far)
        # is above the target, else from T2; a list out of evictable blocks
        # hands over to the other. So: T1 up to that count, then T2, then T1
        # again, each walk resumed where it stopped.
        lists = self._lists
        t1_walk = lists.walk(T1)
        preferred = max(0, lists.sizes[T1] - int(self.target_t1))
        from_t1 = self._victims(t1_walk, protected, min(n, preferred))
        from_t2 = self._victims(lists.walk(T2), protected, n - len(from_t1))
        short = n - len(from_t1) - len(from_t2)
        if short > 0:
            from_t1 += self._victims(t1_walk, protected, short)
            if len(from_t1) + len(from_t2) < n:
                return None
        ghosts, fp = self._ghosts, self._fp
        victims = from_t1 + from_t2
        lists.unlink(victims)
        ghosts.add(B1, [fp[slot] for slot in from_t1])
        ghosts.add(B2, [fp[slot] for slot in from_t2])
        self._trim_ghosts(*lists.sizes)
        return victims

    def _trim_ghosts(self, t1: int, t2: int) -> None:
        """Drops the oldest ghosts that the paper's bounds leave no room for, with
        |T1| = t1 and |T2| = t2: first |T1| + |B1| <= c, then all four lists
        <= 2c, taking from B2 before B1."""
        c, ghosts, b_sizes = self.capacity, self._ghosts, self._ghosts.sizes
        if t1 + b_sizes[B1] > c:
            ghosts.drop_oldest(B1, t1 + b_sizes[B1] - c)
        excess = t1 + t2 + b_sizes[B1] + b_sizes[B2] - 2 * c
        if excess > 0:
            from_b2 = min(excess, b_sizes[B2])
            ghosts.drop_oldest(B2, from_b2)
            ghosts.drop_oldest(B1, excess - from_b2)

    def clear(self) -> None:
        self._lists.clear()
        self._ghosts.clear()
        self.target_t1 = 0.0

    def __len__(self) -> int:
        return len(self._lists)

    def slots(self) -> Iterator[int]:
        yield from self._lists.walk(T1)
        yield from self._lists.walk(T2)

    def check_invariants(self) -> list[str]:
        problems = self._lists.check() + self._ghosts.check()
        t1, t2, b1, b2 = self.sizes
        c = self.capacity
        if t1 + b1 > c or t1 + t2 + b1 + b2 > 2 * c:
            problems.append(f"ARC bounds broken: T1 {t1} T2 {t2} B1 {b1} B2 {b2}, c {c}")
        if not 0.0 <= self.target_t1 <= c:
            problems.append(f"target_t1 {self.target_t1} outside [0, {c}]")
        return problems

    # -- read-only views, for tests and stats ------------------------------------

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """|T1|, |T2|, |B1|, |B2|."""
        (t1, t2), (b1, b2) = self._lists.sizes, self._ghosts.sizes
        return t1, t2, b1, b2

    def in_t2(self, slot: int) -> bool:
        return self._lists.list_of(slot) == T2

    def ghost_list(self, key: Key) -> int | None:
        """1 when `key` is a ghost in B1, 2 in B2, None when it is no ghost."""
        was = self._ghosts.find(hash(key))
        return None if was < 0 else was + 1

    def ghost_fingerprints(self) -> tuple[list[int], list[int]]:
        """The fingerprints of B1 and B2, oldest first."""
        return self._ghosts.fingerprints(B1), self._ghosts.fingerprints(B2)
