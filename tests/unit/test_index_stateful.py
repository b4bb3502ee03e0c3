"""Hypothesis stateful test: BlockIndex against a plain-dict model (SPEC section 4).

The model knows every block's state, ref count and slot (slot allocation is
deterministic: fresh ids ascending, then freed ids last-in-first-out). It cannot
predict ARC's victims, so it checks that every victim was allowed to go and that
`prepare_store` answers `None` exactly when the evictable blocks cannot make
room. For LRU it also keeps the recency order and predicts the victims exactly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvd.core.index import BlockIndex, OffloadingEvent
from kvd.core.index.policies import ARCPolicy
from kvd.errors import ErrorCode, KvdError

KEYS = [bytes([c]) for c in b"abcdefghij"]
SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None)


@dataclass
class Block:
    slot: int
    ready: bool = False
    refs: int = 0


def policy_keys(idx: BlockIndex) -> list[bytes | None]:
    """The policy's resident blocks as keys, in the policy's order (LRU: oldest first)."""
    return [idx.key_at(slot) for slot in idx.policy.slots()]


def snapshot(idx: BlockIndex) -> dict[str, Any]:
    pol = idx.policy
    state: dict[str, Any] = {
        "blocks": {k: (idx.slot_of(k), idx.is_ready(k), idx.ref_cnt(k)) for k in KEYS},
        "order": policy_keys(idx),
        "free": (idx.num_free, idx.freed_slots, idx.next_fresh_slot),
        "counts": (len(idx), idx.num_in_flight, idx.num_pinned, idx.num_ready),
        "events": idx.pending_events,
    }
    if isinstance(pol, ARCPolicy):
        state["arc"] = (pol.sizes, pol.target_t1, pol.ghost_fingerprints())
    return state


class IndexMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.idx = BlockIndex(1, self.policy)
        self.num_blocks = 1
        self.block_tokens = 16
        self.model: dict[bytes, Block] = {}
        self.next_fresh = 0
        self.free: list[int] = []
        self.events: list[OffloadingEvent] = []
        self.recency: list[bytes] = []  # LRU model: oldest first
        self.ghost_hits: set[bytes] = set()  # ARC: keys stored while they were ghosts

    @initialize(num_blocks=st.integers(1, 8), block_tokens=st.sampled_from([1, 16]))
    def init_index(self, num_blocks: int, block_tokens: int) -> None:
        self.idx = BlockIndex(num_blocks, self.policy, block_tokens=block_tokens)
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens

    # -- helpers --------------------------------------------------------------

    def _draw_keys(
        self, data: st.DataObject, pool: Sequence[bytes], max_size: int = 5
    ) -> list[bytes]:
        """Mostly keys from `pool` (likely valid), sometimes any key of the alphabet."""
        if pool and data.draw(st.integers(0, 3), label="from_pool") > 0:
            return data.draw(st.lists(st.sampled_from(sorted(pool)), max_size=max_size))
        return data.draw(st.lists(st.sampled_from(KEYS), max_size=max_size))

    def _misuse(self, call: Callable[[], object], codes: set[ErrorCode]) -> None:
        before = snapshot(self.idx)
        try:
            call()
        except KvdError as exc:
            assert exc.code in codes, (exc.code, codes)
            event(f"misuse: {exc.code}")
        else:
            raise AssertionError(f"expected KvdError with a code in {codes}")
        assert snapshot(self.idx) == before

    def _alloc(self) -> int:
        if self.next_fresh < self.num_blocks:
            self.next_fresh += 1
            return self.next_fresh - 1
        return self.free.pop()

    def _release(self, key: bytes) -> None:
        self.free.append(self.model.pop(key).slot)
        self.recency.remove(key)

    def _model_lookup(self, keys: Sequence[bytes]) -> int | None:
        hits = 0
        for key in keys:
            block = self.model.get(key)
            if block is None:
                break
            if not block.ready:
                return None
            hits += 1
        return hits

    # -- rules ------------------------------------------------------------------

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        keys = self._draw_keys(data, list(self.model))
        before = snapshot(self.idx)
        assert self.idx.lookup(keys) == self._model_lookup(keys)
        assert snapshot(self.idx) == before

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = self._draw_keys(data, [k for k, b in self.model.items() if b.ready])
        missing = [k for k in keys if k not in self.model]
        not_ready = [k for k in keys if k in self.model and not self.model[k].ready]
        if missing or not_ready:
            codes = set()
            if missing:
                codes.add(ErrorCode.MISSING)
            if not_ready:
                codes.add(ErrorCode.NOT_READY)
            self._misuse(lambda: self.idx.prepare_load(keys), codes)
            return
        spec = self.idx.prepare_load(keys)
        assert spec.slots == [self.model[k].slot for k in keys]
        for key in keys:
            self.model[key].refs += 1

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        keys = self._draw_keys(data, list(self.model))
        self.idx.touch(keys)
        for key in reversed(keys):
            if key in self.model:
                self.recency.remove(key)
                self.recency.append(key)

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = [k for k, b in self.model.items() for _ in range(b.refs)]
        keys = self._draw_keys(data, pinned, max_size=4)
        wanted = Counter(keys)
        absent = [k for k in wanted if k not in self.model]
        short = [k for k, n in wanted.items() if k in self.model and self.model[k].refs < n]
        if absent or short:
            codes = {ErrorCode.NOT_PINNED}
            if absent:
                codes.add(ErrorCode.MISSING)
            self._misuse(lambda: self.idx.complete_load(keys), codes)
            return
        self.idx.complete_load(keys)
        for key, n in wanted.items():
            self.model[key].refs -= n

    @rule(data=st.data())
    def prepare_store(self, data: st.DataObject) -> None:
        self._prepare_store(data.draw(st.lists(st.sampled_from(KEYS), max_size=6)))

    @rule(data=st.data())
    def store_and_complete(self, data: st.DataObject) -> None:
        """The engine's usual pair, so that the pool fills up with ready blocks."""
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4))
        new = self._prepare_store(keys)
        if new:
            self._complete_store(new, success=True)

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        in_flight = [k for k, b in self.model.items() if not b.ready]
        keys = self._draw_keys(data, in_flight or list(self.model))
        if any(k not in self.model for k in keys):
            self._misuse(lambda: self.idx.complete_store(keys, success), {ErrorCode.MISSING})
            return
        self._complete_store(keys, success)

    def _prepare_store(self, keys: list[bytes]) -> list[bytes]:
        new = list(dict.fromkeys(k for k in keys if k not in self.model))
        pol = self.idx.policy
        ghosts = {k for k in new if isinstance(pol, ARCPolicy) and pol.ghost_list(k)}
        evictable = [k for k, b in self.model.items() if b.ready and b.refs == 0 and k not in keys]
        need = len(new) - (self.num_blocks - len(self.model))
        if len(new) > self.num_blocks or need > len(evictable):
            event("prepare_store: no room")
            before = snapshot(self.idx)
            assert self.idx.prepare_store(keys) is None
            assert snapshot(self.idx) == before
            return []
        out = self.idx.prepare_store(keys)
        assert out is not None, "spurious None: the evictable blocks could make room"
        assert out.keys_to_store == new
        victims = out.evicted_keys
        assert len(victims) == max(0, need)
        assert len(set(victims)) == len(victims)
        # Never a pinned, in-flight or protected block.
        assert set(victims) <= set(evictable), victims
        if self.policy == "lru":
            assert victims == [k for k in self.recency if k in evictable][: len(victims)]
        event(f"prepare_store: {min(len(victims), 2)}+ victims")
        for key in victims:
            self._release(key)
        slots = [self._alloc() for _ in new]
        assert out.store_spec.slots == slots
        for key, slot in zip(new, slots, strict=True):
            self.model[key] = Block(slot)
            self.recency.append(key)
        self.ghost_hits.difference_update(new)
        self.ghost_hits.update(ghosts)
        if victims:
            self.events.append(OffloadingEvent(victims, self.block_tokens, "CPU", removed=True))
        return new

    def _complete_store(self, keys: list[bytes], success: bool) -> None:
        pending = [k for k in dict.fromkeys(keys) if not self.model[k].ready]
        self.idx.complete_store(keys, success)
        if success:
            for key in pending:
                self.model[key].ready = True
            if pending:
                self.events.append(OffloadingEvent(pending, self.block_tokens, "CPU"))
        else:
            for key in pending:
                self._release(key)

    @rule()
    def take_events(self) -> None:
        assert self.idx.take_events() == self.events
        self.events = []
        assert self.idx.take_events() == []

    @rule(roll=st.integers(0, 3))
    def reset(self, roll: int) -> None:
        if roll:  # keep resets rare so that long histories build up
            return
        self.idx.reset()
        self.model.clear()
        self.next_fresh = 0
        self.free.clear()
        self.events.clear()
        self.recency.clear()
        self.ghost_hits.clear()

    # -- invariants -------------------------------------------------------------

    @invariant()
    def index_invariants(self) -> None:
        assert self.idx.check_invariants() == []

    @invariant()
    def matches_model(self) -> None:
        idx, model = self.idx, self.model
        assert idx.num_free + len(idx) == self.num_blocks
        assert idx.num_free == self.num_blocks - len(model)
        assert len(idx) == len(model) == len(idx.policy)
        assert set(policy_keys(idx)) == set(model)
        slots = [idx.slot_of(k) for k in model]
        assert len(set(slots)) == len(slots)
        for key in KEYS:
            block = model.get(key)
            if block is None:
                assert key not in idx and idx.slot_of(key) is None
                assert idx.lookup([key]) == 0
                continue
            assert idx.slot_of(key) == block.slot
            assert 0 <= block.slot < self.num_blocks
            assert idx.is_ready(key) == block.ready
            assert idx.ref_cnt(key) == block.refs >= 0
            assert idx.lookup([key]) == (1 if block.ready else None)
        assert idx.num_in_flight == sum(not b.ready for b in model.values())
        assert idx.num_pinned == sum(b.refs > 0 for b in model.values())
        assert idx.num_ready == sum(b.ready for b in model.values())

    @invariant()
    def policy_bounds(self) -> None:
        pol = self.idx.policy
        if isinstance(pol, ARCPolicy):
            t1, t2, b1, b2 = pol.sizes
            c = self.num_blocks
            assert t1 + t2 == len(self.model)
            assert t1 + b1 <= c
            assert t1 + t2 + b1 + b2 <= 2 * c
            assert 0 <= pol.target_t1 <= c
            # A block still being stored was never promoted by a touch: if it
            # is in T2, it came back from a ghost list.
            for key, block in self.model.items():
                if not block.ready and pol.in_t2(block.slot):
                    assert key in self.ghost_hits, key
        elif self.policy == "lru":
            assert policy_keys(self.idx) == self.recency


class LRUMachine(IndexMachine):
    policy = "lru"


class ARCMachine(IndexMachine):
    policy = "arc"


class AdaptiveMachine(IndexMachine):
    policy = "adaptive"


TestLRUIndex = LRUMachine.TestCase
TestLRUIndex.settings = SETTINGS
TestARCIndex = ARCMachine.TestCase
TestARCIndex.settings = SETTINGS
TestAdaptiveIndex = AdaptiveMachine.TestCase
TestAdaptiveIndex.settings = SETTINGS


@pytest.mark.parametrize("machine", [LRUMachine, ARCMachine, AdaptiveMachine])
def test_model_catches_a_broken_index(machine: type[IndexMachine]) -> None:
    """The machine is not a tautology: a wrong slot is caught by the invariants."""
    m = machine()
    m.init_index(num_blocks=2, block_tokens=16)
    m.idx.prepare_store([KEYS[0]])
    with pytest.raises(AssertionError):
        m.matches_model()
    m.teardown()
