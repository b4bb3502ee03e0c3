"""ARC-specific behaviour: promotion, adaptation, fallback, ghost bounds, scan resistance,
and the fingerprint ghost lists."""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

import pytest

from kvd.core.index import BlockIndex
from kvd.core.index.policies import ARCPolicy, GhostLists, make_policy
from tests.unit.policy_blocks import Blocks

# Keys, for tests through the index.
A, B, C, D, E, F = (c.encode() for c in "abcdef")
# Slot ids, for tests of the policy alone.
SA, SB, SC, SD, SE = range(5)


def make_arc(capacity: int, blocks: Blocks) -> ARCPolicy:
    pol = make_policy("arc", capacity, blocks.is_ready, blocks.is_evictable)
    assert isinstance(pol, ARCPolicy)
    return pol


def key_of(slot: int) -> bytes:
    """The key a policy-only test stores in `slot`."""
    return b"k%d" % slot


def fill(arc: ARCPolicy, slots: Sequence[int]) -> None:
    arc.insert(slots, [key_of(slot) for slot in slots])


def arc_of(idx: BlockIndex) -> ARCPolicy:
    assert isinstance(idx.policy, ARCPolicy)
    return idx.policy


def in_t2(idx: BlockIndex, key: bytes) -> bool:
    slot = idx.slot_of(key)
    assert slot is not None
    return arc_of(idx).in_t2(slot)


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
    assert not in_t2(idx, A)
    idx.touch([A])
    assert in_t2(idx, A) and not in_t2(idx, B)
    assert arc.sizes == (1, 1, 0, 0)
    idx.touch([A])  # a further hit keeps it in T2
    assert in_t2(idx, A) and arc.sizes == (1, 1, 0, 0)
    assert idx.check_invariants() == []


def test_a_block_still_being_stored_stays_in_t1() -> None:
    idx = BlockIndex(2, "arc")
    arc = arc_of(idx)
    assert idx.prepare_store([A, B]) is not None
    idx.touch([A])
    idx.touch([A, B])
    assert not in_t2(idx, A) and not in_t2(idx, B)
    assert arc.sizes == (2, 0, 0, 0)
    idx.complete_store([A, B])
    assert arc.sizes == (2, 0, 0, 0)  # completing is not a hit
    # The touches still counted as recency within T1: A is now the newer one.
    assert store(idx, [C]) == [B]
    idx.touch([A])
    assert in_t2(idx, A)


# -- adaptation ---------------------------------------------------------------


def test_ghost_hit_in_b1_grows_target_t1_and_comes_back_in_t2() -> None:
    idx = BlockIndex(4, "arc")
    arc = arc_of(idx)
    store(idx, [A, B, C, D])
    idx.touch([C, D])
    assert arc.sizes == (2, 2, 0, 0)  # T1 [A, B], T2 [D, C]
    assert store(idx, [E]) == [A]
    assert arc.sizes == (2, 2, 1, 0) and arc.target_t1 == 0
    assert arc.ghost_list(A) == 1 and arc.ghost_list(B) is None
    assert store(idx, [A]) == [B]  # room first: B goes to B1 too
    # A came back from B1: the target grows by max(1, |B2| / |B1|) = 1, and
    # A starts in T2 (Megiddo & Modha), although it is not hit yet.
    assert arc.target_t1 == 1.0
    assert in_t2(idx, A)
    assert arc.sizes == (1, 3, 1, 0)  # T1 [E], T2 [D, C, A], B1 [B]
    assert arc.ghost_list(A) is None and arc.ghost_list(B) == 1
    assert idx.check_invariants() == []


def test_ghost_hit_in_b2_shrinks_target_t1_and_comes_back_in_t2() -> None:
    idx = BlockIndex(4, "arc")
    arc = arc_of(idx)
    store(idx, [A, B, C, D])
    idx.touch([C, D])
    store(idx, [E])  # A -> B1
    store(idx, [A])  # B -> B1, then the B1 hit: target 1, A in T2
    assert arc.sizes == (1, 3, 1, 0)  # T1 [E], T2 [D, C, A], B1 [B]
    # |T1| = 1 is not above the target: ARC evicts from T2.
    assert store(idx, [F]) == [D]
    assert arc.sizes == (2, 2, 1, 1) and arc.ghost_list(D) == 2
    # |T1| = 2 is above it: T1 gives E; then the B2 hit on D shrinks the
    # target by max(1, |B1| / |B2|) = 2, down to its floor. D starts in T2,
    # even before its store completes (it is not evictable until then).
    out = idx.prepare_store([D])
    assert out is not None and out.evicted_keys == [E]
    assert arc.target_t1 == 0.0
    assert in_t2(idx, D) and not idx.is_ready(D)
    assert arc.sizes == (1, 3, 2, 0)  # T1 [F], T2 [C, A, D], B1 [B, E]
    assert idx.check_invariants() == []
    idx.prepare_load([A, C, F])
    assert idx.prepare_store([E]) is None  # D is in flight, the rest pinned


def test_adaptation_step_is_the_ghost_size_ratio() -> None:
    blocks = Blocks()
    arc = make_arc(4, blocks)
    fill(arc, [SA, SB, SC, SD])
    arc.touch([SA, SB, SC])  # T1 [D], T2 [A, B, C]
    blocks.pinned.add(SD)
    assert arc.evict(3, ()) == [SA, SB, SC]  # T1 has no evictable block: all from T2
    blocks.pinned.clear()
    assert arc.evict(1, ()) == [SD]
    assert arc.sizes == (0, 0, 1, 3)
    arc.insert([SD], [key_of(SD)])  # B1 hit with |B2| / |B1| = 3
    assert arc.target_t1 == 3.0
    arc.insert([SA], [key_of(SA)])  # B2 hit with |B1| / |B2| = 0 / 3: the step is at least 1
    assert arc.target_t1 == 2.0
    assert arc.in_t2(SD) and arc.in_t2(SA)
    assert arc.sizes == (0, 2, 0, 2)
    assert arc.check_invariants() == []


def test_a_ghost_is_found_by_key_whatever_slot_it_comes_back_in() -> None:
    blocks = Blocks()
    arc = make_arc(4, blocks)
    arc.insert([SA], [b"x"])
    assert arc.evict(1, ()) == [SA]
    assert arc.ghost_list(b"x") == 1
    arc.insert([SC], [b"x"])  # another slot, same key: still the ghost hit
    assert arc.in_t2(SC) and arc.target_t1 == 1.0 and arc.sizes == (0, 1, 0, 0)


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
    fill(arc, [SA, SB])
    arc.touch([SA])  # T1 [B], T2 [A]
    arc.target_t1 = 4.0  # T1 is within its target: ARC prefers T2
    snapshot = (arc.sizes, list(arc.slots()))
    blocks.pinned.add(SA)
    assert arc.evict(1, ()) == [SB]
    # Without the pin the preferred list gives the victim.
    arc = make_arc(4, Blocks())
    fill(arc, [SA, SB])
    arc.touch([SA])
    arc.target_t1 = 4.0
    assert (arc.sizes, list(arc.slots())) == snapshot
    assert arc.evict(1, ()) == [SA]


def test_multi_victim_eviction_mixes_lists_and_is_atomic() -> None:
    blocks = Blocks()
    arc = make_arc(6, blocks)
    fill(arc, [SA, SB, SC, SD, SE])
    arc.touch([SD, SE])  # T1 [A, B, C], T2 [D, E]
    blocks.not_ready.add(SA)
    blocks.pinned.update({SB, SE})
    victims = arc.evict(2, ())
    assert victims is not None and sorted(victims) == [SC, SD]
    before = (arc.sizes, list(arc.slots()), arc.target_t1, arc.ghost_fingerprints())
    assert arc.evict(1, ()) is None  # A not ready, B and E pinned
    assert arc.evict(1, [SE]) is None
    assert (arc.sizes, list(arc.slots()), arc.target_t1, arc.ghost_fingerprints()) == before
    assert arc.evict(0, ()) == []
    assert (arc.sizes, list(arc.slots()), arc.target_t1, arc.ghost_fingerprints()) == before
    assert arc.check_invariants() == []


def test_protected_slots_are_skipped() -> None:
    arc = make_arc(4, Blocks())
    fill(arc, [SA, SB, SC])
    assert arc.evict(1, {SA}) == [SB]
    assert arc.evict(1, {SA, SC}) is None


@pytest.mark.parametrize("layout", ["t1", "t2", "t1-pinned-then-t2"])
def test_eviction_skips_pinned_blocks_once_not_once_per_victim(layout: str) -> None:
    blocks = Blocks()
    arc = make_arc(3000, blocks)
    pinned = list(range(1000))
    rest = list(range(1000, 2000))
    blocks.pinned.update(pinned)
    for slot in pinned + rest:
        arc.insert([slot], [key_of(slot)])
        promote = layout == "t2" or (layout == "t1-pinned-then-t2" and slot in rest)
        if promote:
            arc.touch([slot])
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


# -- the ghost lists ---------------------------------------------------------------


def test_ghost_lists_against_a_model_with_colliding_home_cells() -> None:
    """Fingerprints crowd a few home cells of a 16-cell table, so probe runs wrap,
    and removals from the middle of a run must shift the rest back."""
    rng = random.Random(5)
    ghosts = GhostLists(8, 2)
    model: list[list[int]] = [[], []]
    universe = [home + 16 * k for home in (-1, 0, 1, 7, 15) for k in range(-6, 6)]
    for _ in range(5000):
        fp = rng.choice(universe)
        on = next((i for i, m in enumerate(model) if fp in m), -1)
        assert ghosts.find(fp) == on
        roll = rng.random()
        if on < 0 and roll < 0.5 and len(ghosts) < 8:
            lst = rng.randrange(2)
            ghosts.add(lst, [fp])
            model[lst].append(fp)
        elif on >= 0 and roll < 0.75:
            assert ghosts.take(fp) == on
            model[on].remove(fp)
        else:
            lst = rng.randrange(2)
            if model[lst]:
                ghosts.drop_oldest(lst, 1)
                model[lst].pop(0)
        assert [ghosts.fingerprints(0), ghosts.fingerprints(1)] == model
        assert ghosts.sizes == [len(model[0]), len(model[1])]
        assert ghosts.check() == []
    assert ghosts.take(12345) == -1
    ghosts.clear()
    assert len(ghosts) == 0 and ghosts.check() == [] and ghosts.find(universe[0]) == -1


def test_ghost_check_finds_a_broken_table() -> None:
    ghosts = GhostLists(4, 2)
    ghosts.add(0, [3, 11, 19])  # one home cell: a probe run of three
    assert ghosts.check() == []
    ghosts._table[3] = -1  # cut the run: 11 and 19 become unreachable
    assert ghosts.check() != []


def test_arc_keeps_no_key_object() -> None:
    """Ghosts are fingerprints: once evicted, a key is referenced by nobody here."""
    idx = BlockIndex(4, "arc")
    keys = [bytes([100, i]) * 4 for i in range(8)]
    baseline = [sys.getrefcount(k) for k in keys]
    for i in range(0, 8, 2):
        store(idx, keys[i : i + 2])
        idx.touch(keys[i : i + 1])
    idx.take_events()
    arc = arc_of(idx)
    after = [sys.getrefcount(k) for k in keys]
    gone = [i for i, k in enumerate(keys) if k not in idx]
    assert len(gone) == 4 and sum(arc.sizes[2:]) >= 3
    assert sum(arc.ghost_list(keys[i]) is not None for i in gone) == sum(arc.sizes[2:])
    assert [after[i] for i in gone] == [baseline[i] for i in gone]


def test_ghosts_stay_within_2c_when_failed_stores_empty_the_cache() -> None:
    capacity = 4
    idx = BlockIndex(capacity, "arc")
    arc = arc_of(idx)
    for round_ in range(6):
        keys = [b"r%d-%d" % (round_, i) for i in range(capacity)]
        store(idx, keys[:2])
        idx.touch(keys[:1])
        store(idx, keys[2:])
    # Fail every store of a full cache's worth of new keys: resident drops to 0.
    out = idx.prepare_store([b"fail-%d" % i for i in range(capacity)])
    assert out is not None
    idx.complete_store(out.keys_to_store, success=False)
    assert len(idx) == 0
    t1, t2, b1, b2 = arc.sizes
    assert t1 + t2 == 0 and b1 + b2 <= 2 * capacity and b1 <= capacity
    assert idx.check_invariants() == []


def test_batched_calls_decide_as_one_key_at_a_time() -> None:
    """The batch shortcuts (ghosts trimmed once per run of misses, touches split
    by list) leave ARC exactly as one call per key would."""
    rng = random.Random(13)
    capacity = 8
    blocks = Blocks()
    batched, single = make_arc(capacity, blocks), make_arc(capacity, blocks)
    universe = [b"u%d" % i for i in range(30)]
    resident: dict[int, bytes] = {}
    num_ghost_hits = 0

    def state(arc: ARCPolicy) -> object:
        return arc.sizes, list(arc.slots()), arc.target_t1, arc.ghost_fingerprints()

    for _ in range(1500):
        roll = rng.random()
        free = [s for s in range(capacity) if s not in resident]
        if roll < 0.4 and free:
            slots = rng.sample(free, rng.randint(1, len(free)))
            keys = rng.sample([k for k in universe if k not in resident.values()], len(slots))
            num_ghost_hits += sum(batched.ghost_list(k) is not None for k in keys)
            batched.insert(slots, keys)
            for slot, key in zip(slots, keys, strict=True):
                single.insert([slot], [key])
            resident.update(zip(slots, keys, strict=True))
            blocks.not_ready.update(s for s in slots if rng.random() < 0.3)
        elif roll < 0.65 and resident:
            slots = [rng.choice(list(resident)) for _ in range(rng.randint(1, 6))]
            batched.touch(slots)
            for slot in slots:
                single.touch([slot])
        elif roll < 0.9:
            n = rng.randint(0, 4)
            protected = set(rng.sample(list(resident), min(len(resident), rng.randint(0, 2))))
            victims = batched.evict(n, protected)
            assert single.evict(n, protected) == victims
            for slot in victims or []:
                del resident[slot]
        elif resident:
            slots = rng.sample(list(resident), rng.randint(1, len(resident)))
            batched.remove(slots)
            for slot in slots:
                single.remove([slot])
                del resident[slot]
        if rng.random() < 0.3:
            blocks.not_ready.clear()
        blocks.pinned = {s for s in resident if rng.random() < 0.1}
        assert state(batched) == state(single)
        assert batched.check_invariants() == []
    assert num_ghost_hits > 100
