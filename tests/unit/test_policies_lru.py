"""LRU policy: eviction order, atomicity and O(victims + skipped) cost."""

from __future__ import annotations

import pytest

from kvd.errors import ErrorCode, KvdError
from kvd.index.policies import POLICIES, LRUPolicy, make_policy

A, B, C, D, E = (c.encode() for c in "abcde")


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


def make_lru(capacity: int, blocks: Blocks) -> LRUPolicy:
    pol = make_policy("lru", capacity, blocks.is_ready, blocks.is_evictable)
    assert isinstance(pol, LRUPolicy)
    return pol


def test_evicts_least_recently_used_first() -> None:
    lru = make_lru(8, Blocks())
    for key in (A, B, C, D, E):
        lru.insert(key)
    lru.touch(B)
    lru.touch(A)  # order: C D E B A
    assert lru.evict(2, ()) == [C, D]
    assert lru.evict(1, {E}) == [B]
    assert list(lru.keys()) == [E, A]
    assert len(lru) == 2
    assert lru.get(E) and not lru.get(C)


def test_eviction_skips_pinned_not_ready_and_protected() -> None:
    blocks = Blocks()
    lru = make_lru(8, blocks)
    for key in (A, B, C, D, E):
        lru.insert(key)
    blocks.pinned.add(A)
    blocks.not_ready.add(B)
    assert lru.evict(2, {C}) == [D, E]
    assert list(lru.keys()) == [A, B, C]


def test_evict_is_atomic() -> None:
    blocks = Blocks()
    lru = make_lru(8, blocks)
    for key in (A, B, C):
        lru.insert(key)
    blocks.pinned.add(B)
    assert lru.evict(3, ()) is None
    assert lru.evict(2, {A}) is None
    assert list(lru.keys()) == [A, B, C]
    assert lru.evict(0, ()) == []
    assert list(lru.keys()) == [A, B, C]


def test_remove_and_clear() -> None:
    lru = make_lru(8, Blocks())
    for key in (A, B, C):
        lru.insert(key)
    lru.remove(B)
    assert list(lru.keys()) == [A, C]
    lru.clear()
    assert len(lru) == 0 and list(lru.keys()) == []


@pytest.mark.parametrize("num_pinned", [0, 1, 1000])
def test_pinned_head_is_skipped_once_not_once_per_victim(num_pinned: int) -> None:
    blocks = Blocks()
    lru = make_lru(num_pinned + 1000, blocks)
    pinned = [b"p%d" % i for i in range(num_pinned)]
    rest = [b"r%d" % i for i in range(1000)]
    for key in pinned + rest:
        lru.insert(key)
    blocks.pinned.update(pinned)
    blocks.num_checks = 0
    assert lru.evict(100, ()) == rest[:100]
    assert blocks.num_checks <= num_pinned + 100
    # Protected keys are skipped too, once.
    blocks.num_checks = 0
    assert lru.evict(10, set(rest[100:600])) == rest[600:610]
    assert blocks.num_checks <= num_pinned + 500 + 10


def test_unknown_policy_is_a_bad_request() -> None:
    assert set(POLICIES) == {"lru", "arc"}
    with pytest.raises(KvdError) as info:
        make_policy("mru", 4, Blocks().is_ready, Blocks().is_evictable)
    assert info.value.code == ErrorCode.BAD_REQUEST
