"""Runs in the test process: per-session ownership over the block index, no sockets."""

from __future__ import annotations

import pytest

from kvd.core.index import BlockIndex
from kvd.core.ownership import OwnedIndex
from kvd.errors import ErrorCode, KvdError


def ks(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def test_only_the_preparer_completes_a_store() -> None:
    o = OwnedIndex(BlockIndex(8), pin_cap=8)
    o.prepare_store(1, ks("a", "b"))
    with pytest.raises(KvdError) as err:
        o.complete_store(2, ks("a"))
    assert err.value.code == ErrorCode.NOT_OWNER
    assert not o.index.is_ready(b"a")
    o.complete_store(1, ks("a", "b"))
    assert o.index.lookup(ks("a", "b")) == 2
    o.complete_store(2, ks("a"))  # already ready: left as it is, anyone may say so


def test_release_rolls_back_stores_and_pins() -> None:
    o = OwnedIndex(BlockIndex(8), pin_cap=8)
    o.prepare_store(1, ks("a", "b"))
    o.complete_store(1, ks("a", "b"))
    o.prepare_load(2, ks("a", "b"), account=2)
    o.prepare_load(2, ks("a"), account=2)
    o.prepare_store(2, ks("c"))
    assert o.release(2) == (1, 3)
    assert o.index.ref_cnt(b"a") == 0 and b"c" not in o.index
    assert o.index.check_invariants() == []
    assert o.owners() == set() and o.pinned_by(2) == 0


def test_pin_cap_is_per_account_and_atomic() -> None:
    o = OwnedIndex(BlockIndex(8), pin_cap=3)
    o.prepare_store(1, ks("a", "b", "c", "d"))
    o.complete_store(1, ks("a", "b", "c", "d"))
    o.prepare_load(("job", 1), ks("a", "b"), account=5)
    with pytest.raises(KvdError) as err:
        o.prepare_load(("job", 2), ks("c", "d"), account=5)
    assert err.value.code == ErrorCode.PIN_LIMIT
    assert o.index.ref_cnt(b"c") == 0
    o.prepare_load(("job", 3), ks("c", "d"), account=6)
    with pytest.raises(KvdError) as err:
        o.complete_load(("job", 3), ks("a"))
    assert err.value.code == ErrorCode.NOT_OWNER
    o.complete_load(("job", 1), ks("a", "b"))
    assert o.pinned_by(5) == 0 and o.pinned_by(6) == 2
