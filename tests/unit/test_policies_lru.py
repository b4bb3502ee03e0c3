"""LRU policy: eviction order, atomicity, O(victims + skipped) cost, and its slot list."""

from __future__ import annotations

import random

import pytest

from kvd.core.index import BlockIndex
from kvd.core.index.policies import POLICIES, LRUPolicy, SlotLists, make_policy
from kvd.errors import ErrorCode, KvdError
from tests.unit.policy_blocks import Blocks

A, B, C, D, E = range(5)  # slot ids


def make_lru(capacity: int, blocks: Blocks) -> LRUPolicy:
    pol = make_policy("lru", capacity, blocks.is_ready, blocks.is_evictable)
    assert isinstance(pol, LRUPolicy)
    return pol


def fill(pol: LRUPolicy, slots: list[int]) -> None:
    pol.insert(slots, [b"k%d" % slot for slot in slots])
    assert pol.check_invariants() == []


def test_evicts_least_recently_used_first() -> None:
    lru = make_lru(8, Blocks())
    fill(lru, [A, B, C, D, E])
    lru.touch([B, A])  # order: C D E B A
    assert lru.evict(2, ()) == [C, D]
    assert lru.evict(1, {E}) == [B]
    assert list(lru.slots()) == [E, A]
    assert len(lru) == 2
    assert lru.get(E) and not lru.get(C)
    assert lru.check_invariants() == []


def test_eviction_skips_pinned_not_ready_and_protected() -> None:
    blocks = Blocks()
    lru = make_lru(8, blocks)
    fill(lru, [A, B, C, D, E])
    blocks.pinned.add(A)
    blocks.not_ready.add(B)
    assert lru.evict(2, {C}) == [D, E]
    assert list(lru.slots()) == [A, B, C]


def test_evict_is_atomic() -> None:
    blocks = Blocks()
    lru = make_lru(8, blocks)
    fill(lru, [A, B, C])
    blocks.pinned.add(B)
    assert lru.evict(3, ()) is None
    assert lru.evict(2, {A}) is None
    assert list(lru.slots()) == [A, B, C]
    assert lru.evict(0, ()) == []
    assert list(lru.slots()) == [A, B, C]
    assert lru.check_invariants() == []


def test_remove_and_clear() -> None:
    lru = make_lru(8, Blocks())
    fill(lru, [A, B, C])
    lru.remove([B])
    assert list(lru.slots()) == [A, C]
    lru.insert([B], [b"again"])  # a freed slot comes back at the MRU end
    assert list(lru.slots()) == [A, C, B]
    lru.clear()
    assert len(lru) == 0 and list(lru.slots()) == [] and not lru.get(A)
    fill(lru, [C, A])
    assert list(lru.slots()) == [C, A]


@pytest.mark.parametrize("num_pinned", [0, 1, 1000])
def test_pinned_head_is_skipped_once_not_once_per_victim(num_pinned: int) -> None:
    blocks = Blocks()
    lru = make_lru(num_pinned + 1000, blocks)
    pinned = list(range(num_pinned))
    rest = list(range(num_pinned, num_pinned + 1000))
    fill(lru, pinned + rest)
    blocks.pinned.update(pinned)
    blocks.num_checks = 0
    assert lru.evict(100, ()) == rest[:100]
    assert blocks.num_checks <= num_pinned + 100
    # Protected slots are skipped too, once.
    blocks.num_checks = 0
    assert lru.evict(10, set(rest[100:600])) == rest[600:610]
    assert blocks.num_checks <= num_pinned + 500 + 10


def test_unknown_policy_is_a_bad_request() -> None:
    assert {"lru", "arc"} <= set(POLICIES)
    with pytest.raises(KvdError) as info:
        make_policy("mru", 4, Blocks().is_ready, Blocks().is_evictable)
    assert info.value.code == ErrorCode.BAD_REQUEST


# -- the slot lists under every policy ---------------------------------------------


def test_slot_lists_against_python_lists() -> None:
    rng = random.Random(3)
    lists = SlotLists(50, 3)
    model: list[list[int]] = [[], [], []]
    for _ in range(3000):
        node = rng.randrange(50)
        on = next((i for i, m in enumerate(model) if node in m), -1)
        assert lists.list_of(node) == on
        target = rng.randrange(3)
        if on < 0:
            lists.append(target, [node])
            model[target].append(node)
        elif rng.random() < 0.5:
            lists.unlink([node])
            model[on].remove(node)
        else:
            lists.move_to_end(target, [node])
            model[on].remove(node)
            model[target].append(node)
        for lst in range(3):
            assert list(lists.walk(lst)) == model[lst]
            assert lists.sizes[lst] == len(model[lst])
    assert len(lists) == sum(map(len, model))
    assert lists.check() == []
    # Batches, and popping the oldest nodes.
    lists.move_to_end(0, model[1] + model[2])
    model[0] += model[1] + model[2]
    assert list(lists.walk(0)) == model[0] and lists.sizes == [len(model[0]), 0, 0]
    assert lists.pop_oldest(0, 3) == model[0][:3]
    assert lists.pop_oldest(1, 3) == []
    lists.append(2, model[0][:3])
    assert list(lists.walk(0)) == model[0][3:] and list(lists.walk(2)) == model[0][:3]
    assert lists.pop_oldest(2, 10) == model[0][:3] and lists.sizes[2] == 0
    lists.unlink(model[0][3:5])
    assert list(lists.walk(0)) == model[0][5:]
    assert lists.check() == []
    lists.clear()
    assert len(lists) == 0 and lists.check() == [] and list(lists.walk(0)) == []


def test_slot_lists_check_finds_broken_links() -> None:
    def fresh() -> SlotLists:
        lists = SlotLists(4, 2)
        lists.append(0, [0, 2])
        lists.append(1, [1])
        assert lists.check() == []
        return lists

    lists = fresh()
    lists.append(1, [0])  # linked twice: now on two lists
    assert lists.check() != []
    lists = fresh()
    lists._next[0] = 1  # list 0 (nodes 0, 2) now runs into list 1's node
    assert lists.check() != []
    lists = fresh()
    lists._prev[2] = 1  # node 2's prev disagrees with node 0's next
    assert lists.check() != []
    lists = fresh()
    lists.sizes[1] += 1
    assert lists.check() != []
    lists = fresh()
    lists._tag[3] = 1  # tagged, on no list
    assert lists.check() != []


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_resident_slot_is_on_exactly_one_list(policy: str) -> None:
    """An index under churn: the policy's lists hold exactly the allocated slots."""
    rng = random.Random(11)
    idx = BlockIndex(16, policy)
    for step in range(2000):
        keys = [b"%d" % rng.randrange(60) for _ in range(rng.randint(1, 6))]
        hits = idx.lookup(keys) or 0
        idx.touch(keys[:hits])
        out = idx.prepare_store(keys)
        if out is not None and out.keys_to_store:
            idx.complete_store(out.keys_to_store, success=rng.random() < 0.9)
        if step % 50 == 0:
            assert idx.check_invariants() == []
    assert idx.check_invariants() == []
    resident = sorted(s for s in map(idx.slot_of, [b"%d" % i for i in range(60)]) if s is not None)
    assert sorted(idx.policy.slots()) == resident
    assert all(idx.policy.get(s) == (s in resident) for s in range(16))
