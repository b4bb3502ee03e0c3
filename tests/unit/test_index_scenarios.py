"""Scenario tests for every rule of SPEC section 4, run against both policies."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvd.core.index import BlockIndex, LoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from kvd.core.index.policies import ARCPolicy
from kvd.errors import ErrorCode, KvdError

POLICIES = ["lru", "arc", "adaptive"]
# For scenarios that expect the first key of a stored batch to be its oldest
# block; "adaptive" stores a batch tail first (see kvd.core.index.policies.probation).
HEAD_FIRST = pytest.mark.parametrize("policy", ["lru", "arc"])

A, B, C, D, E, F, G, X, Y = (c.encode() for c in "abcdefgxy")


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def policy_keys(idx: BlockIndex) -> list[bytes | None]:
    """The policy's resident blocks as keys, in the policy's order."""
    return [idx.key_at(slot) for slot in idx.policy.slots()]


def snapshot(idx: BlockIndex) -> dict[str, Any]:
    """Everything observable about the index, policy order and pending events included."""
    pol = idx.policy
    order = policy_keys(idx)
    state: dict[str, Any] = {
        "blocks": {k: (idx.slot_of(k), idx.is_ready(k), idx.ref_cnt(k)) for k in order if k},
        "order": order,
        "num_free": idx.num_free,
        "free": idx.freed_slots,
        "next_fresh": idx.next_fresh_slot,
        "counts": (len(idx), idx.num_in_flight, idx.num_pinned, idx.num_ready),
        "events": idx.pending_events,
    }
    if isinstance(pol, ARCPolicy):
        state["arc"] = (pol.sizes, pol.target_t1, pol.ghost_fingerprints())
    return state


def ok(idx: BlockIndex) -> None:
    assert idx.check_invariants() == []


def stored(idx: BlockIndex, keys: Sequence[bytes]) -> PrepareStoreOutput:
    """prepare_store + complete_store(success) of keys that must fit."""
    out = idx.prepare_store(keys)
    assert out is not None
    idx.complete_store(out.keys_to_store)
    ok(idx)
    return out


def raises_code(code: ErrorCode, fn: Callable[[], object]) -> KvdError:
    with pytest.raises(KvdError) as info:
        fn()
    assert info.value.code == code
    return info.value


# -- lookup -------------------------------------------------------------------


def test_lookup_counts_leading_ready_keys(policy: str) -> None:
    idx = BlockIndex(8, policy)
    stored(idx, [A, B, C])
    before = snapshot(idx)
    assert idx.lookup([A, B, C]) == 3
    assert idx.lookup([A, B]) == 2
    assert idx.lookup([B, C, A]) == 3
    assert idx.lookup([]) == 0
    assert snapshot(idx) == before
    ok(idx)


def test_lookup_stops_at_first_miss(policy: str) -> None:
    idx = BlockIndex(8, policy)
    stored(idx, [A, B, C])
    assert idx.lookup([A, X, B, C]) == 1
    assert idx.lookup([X, A, B]) == 0
    assert idx.lookup([A, B, X]) == 2
    # A miss before an in-flight key ends the run: no retry is needed.
    assert idx.prepare_store([D]) is not None
    assert idx.lookup([A, X, D]) == 1
    ok(idx)


def test_lookup_returns_none_when_hit_run_reaches_in_flight_key(policy: str) -> None:
    idx = BlockIndex(8, policy)
    stored(idx, [A])
    assert idx.prepare_store([B, C]) is not None
    before = snapshot(idx)
    assert idx.lookup([A, B]) is None
    assert idx.lookup([B]) is None
    assert idx.lookup([A, C, X]) is None
    assert snapshot(idx) == before
    idx.complete_store([B, C])
    assert idx.lookup([A, B, C, X]) == 3
    ok(idx)


# -- prepare_load -------------------------------------------------------------


def test_prepare_load_pins_and_returns_slots_in_key_order(policy: str) -> None:
    idx = BlockIndex(8, policy)
    stored(idx, [A, B, C])
    spec = idx.prepare_load([C, A])
    assert spec.slots == [idx.slot_of(C), idx.slot_of(A)]
    assert spec.slots == [2, 0]
    assert (idx.ref_cnt(A), idx.ref_cnt(B), idx.ref_cnt(C)) == (1, 0, 1)
    assert idx.num_pinned == 2
    spec = idx.prepare_load([A, A, B])
    assert spec.slots == [0, 0, 1]
    assert (idx.ref_cnt(A), idx.ref_cnt(B), idx.ref_cnt(C)) == (3, 1, 1)
    assert idx.num_pinned == 3
    assert idx.prepare_load([]).slots == []
    ok(idx)


@pytest.mark.parametrize(
    ("batch", "code"),
    [
        ([A, X], ErrorCode.MISSING),
        ([X, A], ErrorCode.MISSING),
        ([A, B, X, C], ErrorCode.MISSING),
        ([A, D], ErrorCode.NOT_READY),
        ([D, A, B], ErrorCode.NOT_READY),
        ([A, A, D], ErrorCode.NOT_READY),
    ],
)
def test_prepare_load_error_changes_nothing(
    policy: str, batch: list[bytes], code: ErrorCode
) -> None:
    idx = BlockIndex(8, policy)
    stored(idx, [A, B, C])
    idx.prepare_load([B])
    assert idx.prepare_store([D]) is not None  # D in flight
    refs = {k: idx.ref_cnt(k) for k in (A, B, C)}
    before = snapshot(idx)
    raises_code(code, lambda: idx.prepare_load(batch))
    assert {k: idx.ref_cnt(k) for k in (A, B, C)} == refs == {A: 0, B: 1, C: 0}
    assert snapshot(idx) == before
    ok(idx)


def test_pinned_blocks_are_never_evicted(policy: str) -> None:
    idx = BlockIndex(2, policy)
    stored(idx, [A, B])
    idx.prepare_load([A])  # A is the LRU block: the natural victim
    out = stored(idx, [C])
    assert out.evicted_keys == [B]
    assert A in idx
    # A pinned, C ready: only C can go; D stays in flight.
    in_flight = idx.prepare_store([D])
    assert in_flight is not None and in_flight.evicted_keys == [C]
    # A pinned, D in flight: nothing can go.
    assert idx.prepare_store([E]) is None
    idx.prepare_load([A])
    idx.complete_load([A])
    assert idx.prepare_store([E]) is None  # still one reference left
    idx.complete_load([A])
    out = stored(idx, [E])
    assert out.evicted_keys == [A]
    ok(idx)


# -- touch --------------------------------------------------------------------


@HEAD_FIRST
def test_without_touch_the_oldest_block_is_the_victim(policy: str) -> None:
    idx = BlockIndex(3, policy)
    stored(idx, [A, B, C])
    assert stored(idx, [D]).evicted_keys == [A]


def test_touch_walks_in_reverse_so_first_key_is_most_recent(policy: str) -> None:
    idx = BlockIndex(3, policy)
    stored(idx, [A, B, C])
    idx.touch([A, B, C])  # recency now C < B < A: C is the oldest
    ok(idx)
    assert stored(idx, [D]).evicted_keys == [C]
    idx.touch([A, D])
    assert stored(idx, [E]).evicted_keys == [B]


@HEAD_FIRST
def test_touch_ignores_absent_keys(policy: str) -> None:
    idx = BlockIndex(3, policy)
    stored(idx, [A, B, C])
    before = snapshot(idx)
    idx.touch([X, Y])
    idx.touch([])
    assert snapshot(idx) == before
    idx.touch([X, A, Y])
    assert X not in idx and Y not in idx
    assert len(idx) == 3 and idx.num_free == 0
    ok(idx)
    assert stored(idx, [D]).evicted_keys == [B]


# -- complete_load ------------------------------------------------------------


def test_complete_load_without_reference_raises_not_pinned(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    before = snapshot(idx)
    raises_code(ErrorCode.NOT_PINNED, lambda: idx.complete_load([A]))
    assert idx.ref_cnt(A) == 0
    assert snapshot(idx) == before
    idx.prepare_load([A])
    idx.complete_load([A])
    assert idx.ref_cnt(A) == 0
    raises_code(ErrorCode.NOT_PINNED, lambda: idx.complete_load([A]))
    assert idx.ref_cnt(A) == 0
    # In flight: never loaded, so never pinned.
    assert idx.prepare_store([C]) is not None
    raises_code(ErrorCode.NOT_PINNED, lambda: idx.complete_load([C]))
    ok(idx)


def test_complete_load_of_absent_key_raises(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A])
    idx.prepare_load([A])
    before = snapshot(idx)
    with pytest.raises(KvdError) as info:
        idx.complete_load([A, X])
    assert info.value.code in (ErrorCode.MISSING, ErrorCode.NOT_PINNED)
    assert idx.ref_cnt(A) == 1
    assert snapshot(idx) == before


def test_complete_load_mixed_batch_changes_nothing(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx.prepare_load([A])
    before = snapshot(idx)
    raises_code(ErrorCode.NOT_PINNED, lambda: idx.complete_load([A, B]))
    assert (idx.ref_cnt(A), idx.ref_cnt(B)) == (1, 0)
    assert snapshot(idx) == before


def test_complete_load_duplicate_keys(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx.prepare_load([A])
    before = snapshot(idx)
    # Listed twice but pinned once: the whole call fails, nothing goes negative.
    raises_code(ErrorCode.NOT_PINNED, lambda: idx.complete_load([A, A]))
    assert idx.ref_cnt(A) == 1
    assert snapshot(idx) == before
    idx.prepare_load([A, B])
    idx.prepare_load([A])
    assert idx.ref_cnt(A) == 3
    idx.complete_load([A, B, A])
    assert (idx.ref_cnt(A), idx.ref_cnt(B)) == (1, 0)
    assert idx.num_pinned == 1
    idx.complete_load([A])
    assert idx.num_pinned == 0
    ok(idx)


# -- prepare_store ------------------------------------------------------------


def test_prepare_store_skips_present_keys(policy: str) -> None:
    idx = BlockIndex(8, policy)
    stored(idx, [A])
    first = idx.prepare_store([B])
    assert first is not None
    out = idx.prepare_store([A, B, C, C, D])
    assert out is not None
    assert out.keys_to_store == [C, D]
    assert out.store_spec.slots == [2, 3]
    assert out.evicted_keys == []
    assert idx.slot_of(B) == first.store_spec.slots[0] == 1
    assert idx.is_ready(A) and not idx.is_ready(B)
    out = idx.prepare_store([A, B, C])
    assert out == PrepareStoreOutput([], LoadStoreSpec([]), [])
    ok(idx)


def test_prepare_store_protects_the_keys_of_this_call(policy: str) -> None:
    idx = BlockIndex(2, policy)
    stored(idx, [A, B])  # A is the oldest: the natural victim
    out = idx.prepare_store([A, C])
    assert out is not None
    assert out.keys_to_store == [C]
    assert out.evicted_keys == [B]
    assert idx.is_ready(A)
    ok(idx)


def test_prepare_store_returns_none_when_only_its_own_keys_are_evictable(policy: str) -> None:
    idx = BlockIndex(2, policy)
    stored(idx, [A, B])
    before = snapshot(idx)
    assert idx.prepare_store([A, B, C]) is None
    assert snapshot(idx) == before


def _setup_full(idx: BlockIndex, pinned: Sequence[bytes], in_flight: Sequence[bytes]) -> None:
    if pinned:
        stored(idx, pinned)
        idx.prepare_load(pinned)
    if in_flight:
        assert idx.prepare_store(in_flight) is not None


@pytest.mark.parametrize(
    ("pinned", "in_flight"),
    [([A, B, C], []), ([], [A, B, C]), ([A], [B, C]), ([A, B], [C])],
    ids=["all-pinned", "all-in-flight", "mixed-1", "mixed-2"],
)
def test_prepare_store_returns_none_and_changes_nothing_when_nothing_evictable(
    policy: str, pinned: list[bytes], in_flight: list[bytes]
) -> None:
    idx = BlockIndex(3, policy)
    _setup_full(idx, pinned, in_flight)
    idx.take_events()
    before = snapshot(idx)
    assert idx.prepare_store([D]) is None
    assert idx.prepare_store([A, D, E]) is None
    assert snapshot(idx) == before
    assert idx.take_events() == []
    ok(idx)


def test_prepare_store_no_partial_store(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx.prepare_load([A])
    # 2 free + 1 evictable (B) < 4 new keys.
    before = snapshot(idx)
    assert idx.prepare_store([C, D, E, F]) is None
    assert snapshot(idx) == before
    assert B in idx and idx.is_ready(B)
    # 3 new keys fit exactly: B goes.
    out = idx.prepare_store([C, D, E])
    assert out is not None
    assert out.evicted_keys == [B]
    ok(idx)


def test_prepare_store_more_new_keys_than_blocks(policy: str) -> None:
    idx = BlockIndex(3, policy)
    before = snapshot(idx)
    assert idx.prepare_store([A, B, C, D]) is None
    assert snapshot(idx) == before
    assert idx.num_free == 3 and len(idx) == 0
    stored(idx, [A])
    before = snapshot(idx)
    assert idx.prepare_store([B, C, D, E]) is None
    assert snapshot(idx) == before
    # Present keys do not count against the pool.
    out = idx.prepare_store([A, B, C])
    assert out is not None and out.keys_to_store == [B, C]
    ok(idx)


def test_fresh_slot_ids_ascend_then_freed_ids_are_reused_lifo(policy: str) -> None:
    idx = BlockIndex(6, policy)
    out = idx.prepare_store([A, B, C])
    assert out is not None and out.store_spec.slots == [0, 1, 2]
    idx.complete_store([A], success=True)
    idx.complete_store([B], success=False)  # frees 1
    idx.complete_store([C], success=False)  # frees 2, on top
    # Fresh ids (3, 4, 5) go first, then freed ones newest-first (2, then 1).
    out = idx.prepare_store([D, E, F, G, X])
    assert out is not None
    assert out.store_spec.slots == [3, 4, 5, 2, 1]
    ok(idx)


@HEAD_FIRST
def test_evicted_slots_are_reused_lifo(policy: str) -> None:
    idx = BlockIndex(3, policy)
    stored(idx, [A, B, C])
    out = idx.prepare_store([D, E])
    assert out is not None
    assert out.evicted_keys == [A, B]
    # A's slot 0 then B's slot 1 were freed: the last freed is reused first.
    assert out.store_spec.slots == [1, 0]
    ok(idx)


def test_store_spec_slots_follow_keys_to_store(policy: str) -> None:
    idx = BlockIndex(8, policy)
    stored(idx, [A])
    out = idx.prepare_store([E, A, C, B])
    assert out is not None
    assert out.keys_to_store == [E, C, B]
    assert out.store_spec.slots == [1, 2, 3]
    assert [idx.slot_of(k) for k in out.keys_to_store] == out.store_spec.slots
    ok(idx)


# -- complete_store -----------------------------------------------------------


def test_complete_store_success_makes_ready_with_one_stored_event(policy: str) -> None:
    idx = BlockIndex(8, policy, block_tokens=32)
    stored(idx, [A])
    idx.take_events()
    assert idx.prepare_store([A, B, C]) is not None
    assert idx.take_events() == []
    idx.complete_store([C, A, B, C])
    assert idx.is_ready(B) and idx.is_ready(C)
    assert idx.take_events() == [OffloadingEvent([C, B], 32, "CPU", removed=False)]
    # Nothing was in flight: no event.
    idx.complete_store([A, B])
    assert idx.take_events() == []
    assert idx.num_in_flight == 0
    ok(idx)


def test_complete_store_failure_frees_only_not_ready_keys(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A])
    idx.prepare_load([A])
    assert idx.prepare_store([B, C]) is not None
    idx.take_events()
    free_before = idx.num_free
    slot_a = idx.slot_of(A)
    idx.complete_store([A, B, C], success=False)
    assert B not in idx and C not in idx
    assert idx.num_free == free_before + 2
    assert idx.slot_of(A) == slot_a and idx.is_ready(A) and idx.ref_cnt(A) == 1
    assert idx.take_events() == []
    assert idx.lookup([A, B]) == 1
    ok(idx)


def test_complete_store_of_absent_key_raises_and_changes_nothing(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A])
    assert idx.prepare_store([B]) is not None
    before = snapshot(idx)
    raises_code(ErrorCode.MISSING, lambda: idx.complete_store([B, X], True))
    assert snapshot(idx) == before
    raises_code(ErrorCode.MISSING, lambda: idx.complete_store([B, X], False))
    assert snapshot(idx) == before
    assert not idx.is_ready(B)


# -- events -------------------------------------------------------------------


@HEAD_FIRST
def test_evictions_emit_one_removed_event_per_prepare_store(policy: str) -> None:
    idx = BlockIndex(3, policy, block_tokens=8)
    stored(idx, [A, B, C])
    assert idx.take_events() == [OffloadingEvent([A, B, C], 8, "CPU", removed=False)]
    out = idx.prepare_store([D, E])
    assert out is not None
    assert sorted(out.evicted_keys) == [A, B]
    assert idx.take_events() == [OffloadingEvent(out.evicted_keys, 8, "CPU", removed=True)]
    idx.complete_store([D, E])
    out = idx.prepare_store([F])
    assert out is not None
    events = idx.take_events()
    assert events == [
        OffloadingEvent([D, E], 8, "CPU", removed=False),
        OffloadingEvent(out.evicted_keys, 8, "CPU", removed=True),
    ]
    assert len(out.evicted_keys) == 1
    ok(idx)


def test_events_do_not_alias_returned_lists(policy: str) -> None:
    idx = BlockIndex(2, policy)
    stored(idx, [A, B])
    idx.take_events()
    out = idx.prepare_store([C, D])
    assert out is not None
    evicted = list(out.evicted_keys)
    out.evicted_keys.clear()  # the caller owns what prepare_store returned
    out.keys_to_store.clear()
    keys = [C, D]
    idx.complete_store(keys)
    keys.clear()
    assert idx.take_events() == [
        OffloadingEvent(evicted, 16, "CPU", removed=True),
        OffloadingEvent([C, D], 16, "CPU", removed=False),
    ]
    assert idx.is_ready(C) and idx.is_ready(D)
    ok(idx)


def test_no_removed_event_without_eviction(policy: str) -> None:
    idx = BlockIndex(4, policy)
    assert idx.prepare_store([A, B]) is not None
    assert idx.take_events() == []
    idx.complete_store([A, B], success=False)
    assert idx.take_events() == []


def test_take_events_drains(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A])
    stored(idx, [B])
    assert len(idx.take_events()) == 2
    assert idx.take_events() == []


# -- reset --------------------------------------------------------------------


def test_reset_drops_everything(policy: str) -> None:
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx.prepare_load([A])
    assert idx.prepare_store([C]) is not None
    stored(idx, [D, E])  # evicts B
    idx.reset()
    ok(idx)
    assert len(idx) == 0 and idx.num_free == 4
    assert (idx.num_in_flight, idx.num_pinned, idx.num_ready) == (0, 0, 0)
    assert list(idx.policy.slots()) == []
    assert idx.take_events() == []
    assert idx.lookup([A]) == 0
    with pytest.raises(KvdError):
        idx.complete_load([A])
    with pytest.raises(KvdError):
        idx.complete_store([C])
    out = idx.prepare_store([E, F])
    assert out is not None and out.store_spec.slots == [0, 1] and out.evicted_keys == []
    if isinstance(idx.policy, ARCPolicy):
        assert idx.policy.sizes == (2, 0, 0, 0) and idx.policy.target_t1 == 0
    ok(idx)


# -- misuse -------------------------------------------------------------------

MISUSE: list[tuple[str, Callable[[BlockIndex], object], ErrorCode | None]] = [
    ("load-missing", lambda i: i.prepare_load([A, X]), ErrorCode.MISSING),
    ("load-not-ready", lambda i: i.prepare_load([B, D]), ErrorCode.NOT_READY),
    ("unload-unpinned", lambda i: i.complete_load([A, B]), ErrorCode.NOT_PINNED),
    ("unload-twice", lambda i: i.complete_load([A, A]), ErrorCode.NOT_PINNED),
    ("unload-in-flight", lambda i: i.complete_load([D]), ErrorCode.NOT_PINNED),
    ("unload-absent", lambda i: i.complete_load([A, X]), None),
    ("store-absent", lambda i: i.complete_store([D, X]), ErrorCode.MISSING),
    ("fail-absent", lambda i: i.complete_store([D, X], success=False), ErrorCode.MISSING),
]


@pytest.mark.parametrize(("call", "code"), [m[1:] for m in MISUSE], ids=[m[0] for m in MISUSE])
def test_misuse_raises_with_code_and_changes_nothing(
    policy: str, call: Callable[[BlockIndex], object], code: ErrorCode | None
) -> None:
    idx = BlockIndex(5, policy)
    stored(idx, [A, B, C])
    idx.touch([B])
    idx.prepare_load([A])
    assert idx.prepare_store([D]) is not None
    stored(idx, [E, F])  # one eviction: ghost history for ARC
    before = snapshot(idx)
    with pytest.raises(KvdError) as info:
        call(idx)
    assert isinstance(info.value.code, ErrorCode)
    if code is not None:
        assert info.value.code == code
    assert snapshot(idx) == before
    ok(idx)


@pytest.mark.parametrize(
    "build",
    [
        lambda: BlockIndex(0),
        lambda: BlockIndex(-1, "arc"),
        lambda: BlockIndex(4, "lru", block_tokens=0),
        lambda: BlockIndex(4, "fifo"),
    ],
)
def test_bad_construction_raises_bad_request(build: Callable[[], BlockIndex]) -> None:
    raises_code(ErrorCode.BAD_REQUEST, build)


def test_check_invariants_detects_corruption(policy: str) -> None:
    # The invariant checker used everywhere above must be able to fail.
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx._refs[idx._slot_of[A]] = -1
    assert idx.check_invariants() != []
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx._slot_of[B] = idx._slot_of[A]
    assert idx.check_invariants() != []
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx.policy.remove([0])  # the index still holds A in slot 0
    assert idx.check_invariants() != []
    idx = BlockIndex(4, policy)
    stored(idx, [A, B])
    idx.policy.insert([3], [X])  # the index has slot 3 free
    assert idx.check_invariants() != []


def test_pin_counts_stay_64_bit_after_a_reset() -> None:
    index = BlockIndex(4)
    index.reset()
    assert index._refs.typecode == "q"  # a reset must not narrow the counters
    out = index.prepare_store([b"k"])
    assert out is not None
    index.complete_store([b"k"])
    index._refs[0] = (1 << 31) - 1  # as many pins as a 32-bit counter holds
    index.prepare_load([b"k"])
    assert index.ref_cnt(b"k") == 1 << 31


@pytest.mark.parametrize("num_blocks", [1000, 10_000])
def test_turnover_does_not_double_the_key_map(policy: str, num_blocks: int) -> None:
    """Under churn CPython would size the key -> slot dict for 3x its live
    entries; the index copies it compact instead, and answers the same."""

    def store(start: int, count: int) -> None:
        for first in range(start, start + count, 64):
            keys = [i.to_bytes(36, "big") for i in range(first, min(first + 64, start + count))]
            out = idx.prepare_store(keys)
            assert out is not None
            idx.complete_store(out.keys_to_store)
            idx.take_events()

    idx = BlockIndex(num_blocks, policy)
    store(0, num_blocks)
    after_fill = sys.getsizeof(idx._slot_of)
    for turn in range(1, 4):
        store(turn * num_blocks, num_blocks)
        assert sys.getsizeof(idx._slot_of) <= after_fill, f"turnover {turn}"
    newest = [i.to_bytes(36, "big") for i in range(4 * num_blocks - 64, 4 * num_blocks)]
    assert idx.lookup(newest) == 64 and idx.num_ready == num_blocks
    assert idx.check_invariants() == []
