"""ARC-specific behaviour: promotion, adaptation, fallback, ghost bounds, scan resistance."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvd.index import BlockIndex
from kvd.index.policies import ARCPolicy, make_policy

A, B, C, D, E, F = (c.encode() for c in "abcdef")


class Blocks:
    """Stand-in for the index's read-only callbacks, with a call counter."""

    def __init__(self) -> None:
        self.not_ready: set[bytes] = set()
        self.pinned: set[bytes] = set()
        self.num_checks = 0

    def is_ready(self, key: bytes) -> bool:
        return key not in self.not_ready

    def is_evictable(self, key: bytes) -> bool:
        self.num_checks += 1
        return key not in self.not_ready and key not in self.pinned


def make_arc(capacity: int, blocks: Blocks) -> ARCPolicy:
    pol = make_policy("arc", capacity, blocks.is_ready, blocks.is_evictable)
    assert isinstance(pol, ARCPolicy)
    return pol


def arc_of(idx: BlockIndex) -> ARCPolicy:
    assert isinstance(idx.policy, ARCPolicy)
    return idx.policy


def store(idx: BlockIndex, keys: Sequence[bytes]) -> list[bytes]:
    out = idx.prepare_store(keys)
    assert out is not None
    idx.complete_store(out.keys_to_store)
    assert idx.check_invariants() == []
    return out.evicted_keys


def request(idx: BlockIndex, keys: Sequence[bytes]) -> None:
    """What an engine does per request: look up, touch and load the hits, store the rest."""
    hits = idx.lookup(keys)
    assert hits is not None
    if hits:
        idx.touch(keys[:hits])
        idx.prepare_load(keys[:hits])
        idx.complete_load(keys[:hits])
    out = idx.prepare_store(keys)
    if out is not None:
        idx.complete_store(out.keys_to_store)


# -- promotion ----------------------------------------------------------------


def test_second_hit_of_a_ready_block_promotes_it_to_t2() -> None:
    idx = BlockIndex(4, "arc")
    arc = arc_of(idx)
    store(idx, [A, B])
    assert arc.sizes == (2, 0, 0, 0)
    assert not arc.in_t2(A)
    idx.touch([A])
    assert arc.in_t2(A) and not arc.in_t2(B)
    assert arc.sizes == (1, 1, 0, 0)
    idx.touch([A])  # a further hit keeps it in T2
    assert arc.in_t2(A) and arc.sizes == (1, 1, 0, 0)
    assert idx.check_invariants() == []


def test_a_block_still_being_stored_stays_in_t1() -> None:
    idx = BlockIndex(2, "arc")
    arc = arc_of(idx)
    assert idx.prepare_store([A, B]) is not None
    idx.touch([A])
    idx.touch([A, B])
    assert not arc.in_t2(A) and not arc.in_t2(B)
    assert arc.sizes == (2, 0, 0, 0)
    idx.complete_store([A, B])
    assert arc.sizes == (2, 0, 0, 0)  # completing is not a hit
    # The touches still counted as recency within T1: A is now the newer one.
    assert store(idx, [C]) == [B]
    idx.touch([A])
    assert arc.in_t2(A)


# -- adaptation ---------------------------------------------------------------


def test_ghost_hit_in_b1_grows_target_t1() -> None:
    idx = BlockIndex(4, "arc")
    arc = arc_of(idx)
    store(idx, [A, B, C, D])
    idx.touch([C, D])
    assert arc.sizes == (2, 2, 0, 0)
    assert store(idx, [E]) == [A]
    assert arc.sizes == (2, 2, 1, 0) and arc.target_t1 == 0
    assert store(idx, [A]) == [B]  # A comes back from B1
    assert arc.target_t1 == 1.0
    assert arc.sizes == (2, 2, 1, 0)  # A left B1, B entered it
    assert idx.check_invariants() == []


def test_ghost_hit_in_b2_shrinks_target_t1() -> None:
    idx = BlockIndex(4, "arc")
    arc = arc_of(idx)
    store(idx, [A, B, C, D])
    idx.touch([C, D])
    store(idx, [E])  # A -> B1
    store(idx, [A])  # B1 hit: target 1, B -> B1
    assert arc.target_t1 == 1.0
    idx.touch([E])  # T1 [A], T2 [D, C, E] (touch walks in reverse)
    assert arc.sizes == (1, 3, 1, 0)
    # |T1| = 1 is not above the target: ARC evicts from T2.
    assert store(idx, [F]) == [D]
    assert arc.sizes == (2, 2, 1, 1)
    # |T1| = 2 is above it: T1 gives A; then the B2 hit on D shrinks the
    # target by max(1, |B1| / |B2|) = 2, down to its floor.
    assert store(idx, [D]) == [A]
    assert arc.target_t1 == 0.0
    assert arc.sizes == (2, 2, 2, 0)
    assert idx.check_invariants() == []


def test_adaptation_step_is_the_ghost_size_ratio() -> None:
    blocks = Blocks()
    arc = make_arc(4, blocks)
    for key in (A, B, C, D):
        arc.insert(key)
    for key in (A, B, C):
        arc.touch(key)  # T1 [D], T2 [A, B, C]
    blocks.pinned.add(D)
    assert arc.evict(3, ()) == [A, B, C]  # T1 has no evictable block: all from T2
    blocks.pinned.clear()
    assert arc.evict(1, ()) == [D]
    assert arc.sizes == (0, 0, 1, 3)
    arc.insert(D)  # B1 hit with |B2| / |B1| = 3
    assert arc.target_t1 == 3.0
    arc.insert(A)  # B2 hit with |B1| / |B2| = 0 / 3: the step is at least 1
    assert arc.target_t1 == 2.0


# -- fallback -----------------------------------------------------------------


def test_falls_back_to_t2_when_t1_has_no_evictable_block() -> None:
    idx = BlockIndex(2, "arc")
    arc = arc_of(idx)
    store(idx, [A, B])
    idx.touch([B])  # T1 [A], T2 [B]; target 0: ARC prefers T1
    idx.prepare_load([A])
    assert store(idx, [C]) == [B]
    assert arc.sizes == (2, 0, 0, 1)


def test_falls_back_to_t1_when_t2_has_no_evictable_block() -> None:
    blocks = Blocks()
    arc = make_arc(4, blocks)
    arc.insert(A)
    arc.insert(B)
    arc.touch(A)  # T1 [B], T2 [A]
    arc.target_t1 = 4.0  # T1 is within its target: ARC prefers T2
    snapshot = (arc.sizes, list(arc.keys()))
    blocks.pinned.add(A)
    assert arc.evict(1, ()) == [B]
    # Without the pin the preferred list gives the victim.
    arc = make_arc(4, Blocks())
    arc.insert(A)
    arc.insert(B)
    arc.touch(A)
    arc.target_t1 = 4.0
    assert (arc.sizes, list(arc.keys())) == snapshot
    assert arc.evict(1, ()) == [A]


def test_multi_victim_eviction_mixes_lists_and_is_atomic() -> None:
    blocks = Blocks()
    arc = make_arc(6, blocks)
    for key in (A, B, C, D, E):
        arc.insert(key)
    arc.touch(D)
    arc.touch(E)  # T1 [A, B, C], T2 [D, E]
    blocks.not_ready.add(A)
    blocks.pinned.update({B, E})
    victims = arc.evict(2, ())
    assert victims is not None and sorted(victims) == [C, D]
    before = (arc.sizes, list(arc.keys()), arc.target_t1)
    assert arc.evict(1, ()) is None  # A not ready, B and E pinned
    assert arc.evict(1, [E]) is None
    assert (arc.sizes, list(arc.keys()), arc.target_t1) == before
    assert arc.evict(0, ()) == []
    assert (arc.sizes, list(arc.keys()), arc.target_t1) == before


def test_protected_keys_are_skipped() -> None:
    arc = make_arc(4, Blocks())
    for key in (A, B, C):
        arc.insert(key)
    assert arc.evict(1, {A}) == [B]
    assert arc.evict(1, {A, C}) is None


@pytest.mark.parametrize("layout", ["t1", "t2", "t1-pinned-then-t2"])
def test_eviction_skips_pinned_blocks_once_not_once_per_victim(layout: str) -> None:
    blocks = Blocks()
    arc = make_arc(3000, blocks)
    pinned = [b"p%d" % i for i in range(1000)]
    rest = [b"r%d" % i for i in range(1000)]
    blocks.pinned.update(pinned)
    for key in pinned + rest:
        arc.insert(key)
        promote = layout == "t2" or (layout == "t1-pinned-then-t2" and key in rest)
        if promote:
            arc.touch(key)
    blocks.num_checks = 0
    assert arc.evict(100, ()) == rest[:100]
    assert blocks.num_checks <= len(pinned) + 100


# -- bounds and workloads -------------------------------------------------------


def test_ghost_lists_stay_bounded() -> None:
    rng = random.Random(7)
    capacity = 8
    idx = BlockIndex(capacity, "arc")
    arc = arc_of(idx)
    keys = [b"k%d" % i for i in range(40)]
    max_ghosts = (0, 0)
    for _ in range(3000):
        start = rng.randrange(len(keys) - 3)
        batch = keys[start : start + rng.randint(1, 3)]
        request(idx, batch)
        if rng.random() < 0.1:
            hits = idx.lookup(batch) or 0
            idx.prepare_load(batch[:hits])
            idx.touch(batch)
            out = idx.prepare_store([rng.choice(keys)])
            idx.complete_load(batch[:hits])
            if out is not None and out.keys_to_store:
                idx.complete_store(out.keys_to_store, success=rng.random() < 0.5)
        t1, t2, b1, b2 = arc.sizes
        assert t1 + b1 <= capacity
        assert t1 + t2 + b1 + b2 <= 2 * capacity
        assert 0 <= arc.target_t1 <= capacity
        max_ghosts = (max(max_ghosts[0], b1), max(max_ghosts[1], b2))
        assert idx.check_invariants() == []
    # The workload did exercise both ghost lists.
    assert max_ghosts[0] > 0 and max_ghosts[1] > 0


def _scan_survivors(policy: str) -> int:
    capacity = 64
    idx = BlockIndex(capacity, policy)
    working = [[b"w%d-%d" % (r, i) for i in range(8)] for r in range(4)]  # 32 blocks
    for _ in range(2):  # stored once, then hit: reused blocks
        for keys in working:
            request(idx, keys)
    assert all(idx.lookup(keys) == 8 for keys in working)
    scan = [b"s%d" % i for i in range(3 * capacity)]
    for i in range(0, len(scan), 8):
        request(idx, scan[i : i + 8])
    assert idx.check_invariants() == []
    return sum(key in idx for keys in working for key in keys)


def test_arc_resists_a_scan_that_flushes_lru() -> None:
    assert _scan_survivors("lru") == 0
    assert _scan_survivors("arc") >= 30  # of 32
