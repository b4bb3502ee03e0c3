"""Runs in the daemon (pure core): the block index of one pool (SPEC section 4).

No sockets, files, clocks or threads: every method is a pure state transition,
so the daemon, the benchmarks and the property tests drive the same object.

Per-block state and the read-only views live in `IndexState`
(`kvd.core.index.index_state`, with its picture); this module holds the verbs.

Churn would double the dict: deleted entries keep their place until CPython
resizes, and a resize sizes the dict for 3x its live entries (rounded up to
a power of two), so a full index that only turns over sits at 84 to 105
bytes an entry. So when `prepare_store` sees the dict grow after at least
1/16 of its live count was deleted since the last growth (turnover, not a
filling index), it copies it (`dict(d)` sizes for 1.5x), back to 42 to 52.
The copy is O(n) once per n/16 insertions at most (at 1,000,000 blocks, once
per ~400,000): the amortized cost per key stays O(1).

Every method validates its whole batch before it mutates anything: misuse raises
a `KvdError` and leaves the index exactly as it was.
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter
from collections.abc import Sequence

from kvd.core.index.checks import adoption
from kvd.core.index.index_state import IndexState
from kvd.core.index.policies.adoption import AdoptingPolicy
from kvd.core.index.types import Key, LoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from kvd.errors import BadRequest, MissingKey, NotPinned


class BlockIndex(IndexState):
    """Where each block of one pool lives, its state, and who may be evicted."""

    # -- the verbs ----------------------------------------------------------

    def lookup(self, keys: Sequence[Key]) -> int | None:
        """The number of leading keys present and ready; `None` = retry later.

        The run of hits stops at the first absent key; reaching a key whose
        store is still in flight answers `None`. Changes no state."""
        hits = 0
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None:
                break
            if not self._ready[slot]:
                self.policy.record_lookup(keys)
                return None
            hits += 1
        self.policy.record_lookup(keys)
        return hits

    def observe(self, keys: Sequence[Key]) -> None:
        """What `lookup` teaches the policy, for a lookup answered elsewhere (from
        the ready table, SPEC section 15). Changes no state the verbs answer."""
        self.policy.record_lookup(keys)

    def prepare_load(self, keys: Sequence[Key]) -> LoadStoreSpec:
        """Pins every key (`ref_cnt += 1`) and returns their slots in key order.

        Every key must be present (else `MissingKey`) and ready (else
        `NotReady`); on error nothing is pinned."""
        slots = [self._ready_slot(key) for key in keys]
        refs = self._refs
        first: list[int] = []
        for slot in slots:
            if refs[slot] == 0:
                first.append(slot)
            refs[slot] += 1
        if first:
            self._num_pinned += len(first)
            if self.slot_sink is not None:
                self.slot_sink.pinned(first)
        return LoadStoreSpec(slots)

    def touch(self, keys: Sequence[Key]) -> None:
        """Marks keys recently used; reversed, so the first (prefix) key ends most recent."""
        slots = map(self._slot_of.get, reversed(keys))
        self.policy.touch([slot for slot in slots if slot is not None])

    def complete_load(self, keys: Sequence[Key]) -> None:
        """Drops one load reference per key (a key listed twice drops two).

        A key that is absent (`MissingKey`) or holds fewer references than
        asked (`NotPinned`) fails the whole call; no count goes negative."""
        wanted = Counter(keys)
        slots: list[tuple[int, int]] = []
        for key, count in wanted.items():
            slot = self._slot_of.get(key)
            if slot is None:
                raise MissingKey(f"complete_load of absent key {key.hex()}")
            if self._refs[slot] < count:
                raise NotPinned(
                    f"complete_load of key {key.hex()} x{count} but it holds "
                    f"{self._refs[slot]} load reference(s)"
                )
            slots.append((slot, count))
        refs = self._refs
        last: list[int] = []
        for slot, count in slots:
            refs[slot] -= count
            if refs[slot] == 0:
                last.append(slot)
        if last:
            self._num_pinned -= len(last)
            if self.slot_sink is not None:
                self.slot_sink.unpinned(last)

    def prepare_store(self, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        """Allocates slots for the keys not yet present, evicting if it must.

        Keys already present (ready or in flight) are skipped; the keys of
        this call are protected from eviction. When free slots plus what the
        policy can evict cannot hold them all, returns `None` and changes
        nothing. New keys are inserted not ready, on fresh slot ids in
        ascending order first, then on freed ids last-in-first-out.
        """
        slot_of, key_at, free = self._slot_of, self._key_at, self._free
        unique = dict.fromkeys(keys)
        new_keys = [key for key in unique if key not in slot_of]
        if len(new_keys) > self.num_blocks:
            return None
        need = len(new_keys) - self.num_free
        evicted: list[Key] = []
        if need > 0:
            # The present keys of the call are protected; all-new keys need no set.
            protected = (
                {slot_of[key] for key in unique if key in slot_of}
                if len(new_keys) < len(unique)
                else ()
            )
            victims = self.policy.evict(need, protected)
            if victims is None:
                return None
            ready = self._ready
            for slot in victims:
                key = key_at[slot]
                assert key is not None, "the policy evicted a free slot"
                del slot_of[key]
                evicted.append(key)
                key_at[slot] = None
                ready[slot] = 0  # refs are 0 already: victims are unpinned
                free.append(slot)
        slots: list[int] = []
        fresh = self._next_fresh
        for key in new_keys:
            # Fresh ids ascending first, then freed ones last-in-first-out.
            if fresh < self.num_blocks:
                slot = fresh
                fresh += 1
            else:
                slot = free.pop()
            slot_of[key] = slot
            key_at[slot] = key
            slots.append(slot)
        self._next_fresh = fresh
        self._deleted += len(evicted)
        # Every victim's slot is among `slots` (the call needs all the free room,
        # or it evicts nothing): one write takes it out of the ready set too.
        if slots and self.slot_sink is not None:
            self.slot_sink.storing(slots)
        if sys.getsizeof(slot_of) > self._slot_of_bytes:
            self._regrown()
        self.policy.insert(slots, new_keys)
        self._num_not_ready += len(new_keys)
        if self.sink is not None:
            if evicted:
                self.sink.gone(evicted)
            if new_keys:
                self.sink.storing(new_keys)
        if evicted:
            # A copy: the caller owns `evicted_keys`, the pending event must not change with it.
            self._events.append(
                OffloadingEvent(list(evicted), self.block_tokens, self.medium, True, self.locality)
            )
        return PrepareStoreOutput(new_keys, LoadStoreSpec(slots), evicted)

    def complete_store(self, keys: Sequence[Key], success: bool = True) -> None:
        """Finishes stores: success makes the not-ready keys ready (one stored
        event); failure frees the not-ready keys (no event). Keys already ready
        are left as they are; an absent key (`MissingKey`) fails the call."""
        slot_of = self._slot_of
        pending: dict[Key, int] = {}
        for key in keys:
            slot = slot_of.get(key)
            if slot is None:
                raise MissingKey(f"complete_store of absent key {key.hex()}")
            if not self._ready[slot]:
                pending[key] = slot
        if not pending:
            return
        self._num_not_ready -= len(pending)
        if success:
            for slot in pending.values():
                self._ready[slot] = 1
            self._events.append(
                OffloadingEvent(list(pending), self.block_tokens, self.medium, False, self.locality)
            )
            if self.slot_sink is not None:
                self.slot_sink.ready(list(pending.values()), list(pending))
        else:
            self.policy.remove(pending.values())
            for key, slot in pending.items():
                del slot_of[key]
                self._release_slot(slot)
            self._deleted += len(pending)
            if self.slot_sink is not None:
                self.slot_sink.freed(list(pending.values()))
        if self.sink is not None:
            (self.sink.ready if success else self.sink.gone)(list(pending))

    def discard(self, keys: Sequence[Key]) -> list[Key]:
        """Removes the ready, unpinned keys among `keys` (a damaged copy found by a
        read); the others stay. One removed event; the removed keys."""
        slot_of, ready, refs = self._slot_of, self._ready, self._refs
        gone = {}
        for key in dict.fromkeys(keys):
            slot = slot_of.get(key)
            if slot is not None and ready[slot] and refs[slot] == 0:
                gone[key] = slot
        if not gone:
            return []
        self.policy.remove(gone.values())
        for key, slot in gone.items():
            del slot_of[key]
            self._release_slot(slot)
        self._deleted += len(gone)
        if self.slot_sink is not None:
            self.slot_sink.freed(list(gone.values()))
        if self.sink is not None:
            self.sink.gone(list(gone))
        self._events.append(
            OffloadingEvent(list(gone), self.block_tokens, self.medium, True, self.locality)
        )
        return list(gone)

    def _regrown(self) -> None:
        """`_slot_of` just grew: under turnover, a compact copy (module docstring)."""
        if 16 * self._deleted >= len(self._slot_of):
            self._slot_of = dict(self._slot_of)
        self._slot_of_bytes = sys.getsizeof(self._slot_of)
        self._deleted = 0

    def take_events(self) -> list[OffloadingEvent]:
        """Drains the events emitted since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def settle(self) -> bool:
        """One step of the work the policy kept off the latency path; True while
        more remains. Call when idle.

        Never changes what the verbs answer: a policy that defers work catches
        up by itself before it next inserts or evicts."""
        return self.policy.settle()

    def has_idle_work(self) -> bool:
        """Whether `settle` has anything to do."""
        return self.policy.has_idle_work()

    def reset(self) -> None:
        """Drops every block, pinned or in flight, and any undrained event; held
        slots stay held."""
        n = self.num_blocks
        self._slot_of.clear()
        self._slot_of_bytes = sys.getsizeof(self._slot_of)
        self._deleted = 0
        self._key_at = [None] * n
        self._ready = bytearray(n)
        self._refs = array("q", bytes(8 * n))  # 64-bit, as at start
        self._free = array("i")
        self._next_fresh = 0
        if self._held:  # every other slot is free, the lowest first
            held = set(self._held)
            self._free = array("i", (s for s in range(n - 1, -1, -1) if s not in held))
            self._next_fresh = n
        self._num_not_ready = 0
        self._num_pinned = 0
        self._events.clear()
        self.policy.clear()
        if self.sink is not None:
            self.sink.reset()
        if self.slot_sink is not None:
            self.slot_sink.reset()
            if self._held:
                self.slot_sink.storing(self._held)

    def adopt(
        self,
        slots: list[int],
        keys: list[Key],
        *,
        policy_later: bool = False,
        slot_of: dict[Key, int] | None = None,
        held: Sequence[int] = (),
    ) -> None:
        """Fills an empty index with ready blocks in their slots (warm restart, SPEC 13),
        oldest first: `keys[i]` in `slots[i]`, the `held` slots (a job of the dead
        daemon may still write them) neither free nor allocated until
        `release_held`, the rest free; one stored event; the sink told, the slot
        sink not. `policy_later`: the policy learns them a slice per `settle`
        (`AdoptingPolicy`); `slot_of`: `dict(zip(keys, slots))`, if at hand.
        The lists become the index's, not copied (a copy of 1M touches 1M objects)."""
        if self._slot_of or self._next_fresh:
            raise BadRequest("adopt needs an empty index")
        state = adoption(self.num_blocks, slots, keys, slot_of, held)
        self._slot_of, self._key_at, self._ready, self._free = state
        self._held = sorted(held)
        self._slot_of_bytes = sys.getsizeof(self._slot_of)
        self._next_fresh = self.num_blocks
        if not keys:
            return
        if self.sink is not None:
            self.sink.adopted(keys)
        if policy_later:
            back = lambda policy: setattr(self, "policy", policy)  # noqa: E731 - once done
            self.policy = AdoptingPolicy(self.policy, slots, keys, back)
        else:
            self.policy.adopt(slots, keys)
        self._events.append(
            OffloadingEvent(keys, self.block_tokens, self.medium, False, self.locality)
        )

    def release_held(self) -> int:
        """Frees the held slots (`adopt`), lowest first to be reused; how many."""
        held, self._held = self._held, []
        if held:
            self._free.extend(reversed(held))
            if self.slot_sink is not None:
                self.slot_sink.freed(held)
        return len(held)
