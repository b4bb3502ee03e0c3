"""A warm restart's policy adopted a slice at a time (`AdoptingPolicy`, SPEC 13).

The index adopted with `policy_later=True` must end exactly where the index
adopted at once ends: same victims, same order, for every policy, whatever
lookups and touches came while the policy was still learning the blocks.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvd.core.index.policies.adoption as adoption_module
from kvd.core.index import BlockIndex
from kvd.core.index.policies.adoption import AdoptingPolicy

POLICIES = ["lru", "arc", "adaptive"]
N = 64


def _key(i: int) -> bytes:
    return b"k%05d" % i


def _adopted(policy: str, later: bool, n_ready: int, seed: int) -> BlockIndex:
    """An index of N slots with n_ready blocks adopted in a shuffled slot order."""
    slots = list(range(N))
    random.Random(seed).shuffle(slots)
    index = BlockIndex(N, policy)
    index.adopt(slots[:n_ready], [_key(i) for i in range(n_ready)], policy_later=later)
    return index


def _order(index: BlockIndex) -> list[bytes | None]:
    return [index.key_at(slot) for slot in index.policy.slots()]


# One step of a workload: lookups and touches (kept while adopting), a settle
# (one slice), or a store that evicts (finishes the adoption at once).
steps = st.lists(
    st.one_of(
        st.tuples(st.just("lookup"), st.lists(st.integers(0, 80), min_size=1, max_size=6)),
        st.tuples(st.just("touch"), st.lists(st.integers(0, 80), min_size=1, max_size=6)),
        st.tuples(st.just("settle"), st.just([])),
        st.tuples(st.just("store"), st.lists(st.integers(100, 200), min_size=1, max_size=8)),
        st.tuples(st.just("again"), st.just([])),  # the last lookup once more
        st.tuples(st.just("reset"), st.just([])),
    ),
    max_size=30,
)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(work=steps, n_ready=st.integers(1, N), seed=st.integers(0, 3), slice_=st.integers(1, 9))
def test_an_index_adopted_in_slices_ends_as_one_adopted_at_once(
    policy: str,
    work: list[tuple[str, list[int]]],
    n_ready: int,
    seed: int,
    slice_: int,
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(adoption_module, "ADOPT_SLICE", slice_)
        _compare(policy, work, n_ready, seed)


def _compare(policy: str, work: list[tuple[str, list[int]]], n_ready: int, seed: int) -> None:
    at_once = _adopted(policy, False, n_ready, seed)
    sliced = _adopted(policy, True, n_ready, seed)
    assert isinstance(sliced.policy, AdoptingPolicy)
    last: list[bytes] = [_key(0)]
    for step, ids in work:
        verb, keys = ("lookup", last) if step == "again" else (step, [_key(i) for i in ids])
        if verb == "lookup":
            last = keys
            assert sliced.lookup(keys) == at_once.lookup(keys)
            continue
        for index in (at_once, sliced):
            if verb == "touch":
                index.touch(keys)
            elif verb == "settle":
                index.settle()
            elif verb == "reset":
                index.reset()
            else:
                out = index.prepare_store(keys)
                if out is not None:
                    index.complete_store(out.keys_to_store)
        if verb in ("store", "reset"):
            assert not isinstance(sliced.policy, AdoptingPolicy)
            assert _order(sliced) == _order(at_once)
    while sliced.settle():
        pass
    assert not isinstance(sliced.policy, AdoptingPolicy)  # handed back once done
    assert sliced.check_invariants() == at_once.check_invariants() == []
    assert _order(sliced) == _order(at_once)
    # And from here on both evict the same blocks.
    out_a = at_once.prepare_store([_key(1000 + i) for i in range(N)])
    out_s = sliced.prepare_store([_key(1000 + i) for i in range(N)])
    assert out_a is not None and out_s is not None
    assert out_s.evicted_keys == out_a.evicted_keys


@pytest.mark.parametrize("policy", POLICIES)
def test_lookups_and_loads_answer_at_once_while_the_policy_learns(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adoption_module, "ADOPT_SLICE", 10)
    index = _adopted(policy, True, N, 0)
    keys = [_key(i) for i in range(N)]
    assert index.has_idle_work()
    assert index.lookup(keys) == N
    spec = index.prepare_load(keys[:5])
    index.touch(keys[:5])
    index.complete_load(keys[:5])
    assert len(spec.slots) == 5
    steps = 0
    while index.settle():
        steps += 1
    assert steps >= N // 10 - 1  # a slice at a time, not all at once
    assert not index.has_idle_work() or policy == "adaptive"
    assert sorted(index.policy.slots()) == list(range(N))


def test_a_long_backlog_finishes_the_adoption_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adoption_module, "ADOPT_SLICE", 4)
    monkeypatch.setattr(adoption_module, "MAX_KEPT_KEYS", 10)
    index = _adopted("adaptive", True, N, 0)
    for i in range(5):
        index.lookup([_key(i), _key(i + 1)])  # 2 keys each: 10 kept, not over yet
    assert isinstance(index.policy, AdoptingPolicy)
    index.touch([_key(9)])  # the 11th
    assert not isinstance(index.policy, AdoptingPolicy)
    assert len(index.policy) == N


def test_an_empty_adoption_needs_no_slices() -> None:
    index = BlockIndex(8, "arc")
    index.adopt([], [], policy_later=True)
    assert not isinstance(index.policy, AdoptingPolicy)
    assert not index.has_idle_work()
    assert index.take_events() == []


def test_a_reset_while_adopting_drops_what_is_left_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adoption_module, "ADOPT_SLICE", 4)
    index = _adopted("adaptive", True, N, 0)
    adopting = index.policy
    assert isinstance(adopting, AdoptingPolicy)
    index.lookup([_key(1)])
    index.reset()
    assert not isinstance(index.policy, AdoptingPolicy)
    assert adopting._at == 0  # nothing more was adopted to be thrown away
    assert len(index.policy) == 0 and index.check_invariants() == []


def test_lookups_are_kept_only_for_a_policy_that_learns_from_them() -> None:
    lru, adaptive = _adopted("lru", True, N, 0), _adopted("adaptive", True, N, 0)
    for index in (lru, adaptive):
        for _ in range(3):
            index.lookup([_key(1), _key(2)])  # the same lookup again: kept once
        index.lookup([_key(3)])
    assert isinstance(lru.policy, AdoptingPolicy) and isinstance(adaptive.policy, AdoptingPolicy)
    assert lru.policy._num_kept_keys == 0
    assert adaptive.policy._num_kept_keys == 3
