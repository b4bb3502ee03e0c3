"""`Observe` in the daemon: its bounds, and the queue the policies learn from a slice at a time."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from kvd.control import observed as ob
from kvd.errors import BadRequest
from kvd_client import protocol as p


def keys(n: int, base: int = 0) -> list[bytes]:
    return [(base + i).to_bytes(8, "big") for i in range(n)]


def test_an_observe_is_bounded_by_its_keys_and_its_hits() -> None:
    assert ob.check_observe(p.Observe(1, [keys(3), keys(2)], [3, 0])) == 5
    assert ob.check_observe(p.Observe(1, [keys(3)])) == 3  # hits may be left out
    for bad in (
        p.Observe(1, [keys(p.MAX_KEYS_PER_REQUEST), keys(1)], [0, 0]),
        p.Observe(1, [keys(3)], [4]),
        p.Observe(1, [keys(3), keys(1)], [1]),
        p.Observe(1, [keys(3)], [1, 0]),
    ):
        with pytest.raises(BadRequest):
            ob.check_observe(bad)


def test_an_oversized_observe_is_told_from_its_headers() -> None:
    huge = [[bytes([i % 250 + 1])] * 40_000 for i in range(3)]
    frame = p.encoder.encode(p.Observe(7, huge, [0, 0, 0]))
    assert ob.oversized(frame) == (7, ob._too_many(120_000))
    fits = p.encoder.encode(p.Observe(7, [[b"k" * 8] * 60_000], [0]))
    assert ob.oversized(fits) is None
    assert ob.oversized(p.encoder.encode(p.Lookup(3, [b"k" * 8] * 70_000))) is None
    assert ob.oversized(b"\xc1" * (ob.OVERSIZED_FROM_BYTES + 1)) is None


class FakeIndex:
    def __init__(self) -> None:
        self.seen: list[list[bytes]] = []

    def observe(self, keys: list[bytes]) -> None:
        self.seen.append(keys)


class FakePool:
    def __init__(self, name: str) -> None:
        self.name, self.resetting, self.index = name, False, FakeIndex()


class FakePools:
    def __init__(self, *pools: FakePool) -> None:
        self.pools = {pool.name: pool for pool in pools}

    def find(self, name: str) -> Any:
        return self.pools.get(name)


def test_the_policy_learns_a_slice_a_turn_and_the_queue_is_bounded() -> None:
    pool, counters = FakePool("a"), Counter[str]()
    q = ob.ObservedLookups(FakePools(pool), counters)  # type: ignore[arg-type]
    long = keys(3 * ob.OBSERVE_KEYS_PER_TURN + 5)
    q.add(pool, p.Observe(1, [keys(10, 1 << 40), long], [10, 0]))  # type: ignore[arg-type]
    assert (counters["lookups"], counters["hit_blocks"], counters["lookup_keys"]) == (
        2, 10, 10 + len(long),
    )  # fmt: skip
    turns = 1
    while q.apply():
        turns += 1
    assert turns == 4 and q.queued_keys == 0
    seen = pool.index.seen
    assert seen[0] == keys(10, 1 << 40) and [k for piece in seen[1:] for k in piece] == long
    assert max(map(len, seen)) <= ob.OBSERVE_KEYS_PER_TURN
    for n in range(6):  # more than the queue holds: the oldest go, counted
        q.add(pool, p.Observe(1, [keys(p.MAX_KEYS_PER_REQUEST, n << 32)], [0]))  # type: ignore[arg-type]
    assert q.queued_keys == ob.MAX_QUEUED_KEYS
    assert counters["observed_keys_dropped"] == 6 * p.MAX_KEYS_PER_REQUEST - ob.MAX_QUEUED_KEYS
    pool.resetting = True  # a pool being reset learns nothing
    pool.index.seen.clear()
    while q.apply():
        pass
    assert pool.index.seen == [] and q.queued_keys == 0
