"""Runs in the daemon (pure core): a block index's per-slot state and its read-only views.

Per-block state lives in flat arrays indexed by slot id, and the policy
orders slot ids in arrays of its own, so the one per-key structure is the
key -> slot dict:

    _slot_of   {key -> slot}                                 dict
    _key_at    [slot] -> key | None                          list
    _ready     [slot] -> 0 (being stored) | 1 (loadable)     bytearray
    _refs      [slot] -> number of load references (pins)    array('q')
    free slots = [_next_fresh, num_blocks) fresh ids, then _free (array('i'),
                 a LIFO stack of freed ids)
    _held      slots a job of an earlier daemon may still write (a warm
               start, SPEC 13): neither free nor allocated until released

At 1,000,000 blocks a block costs (tracemalloc, `kvd bench index`): its key
object 72 bytes (36-byte keys), its `_slot_of` entry about 42, its slot int
32, `_key_at` 8, `_ready` 1 and `_refs` 8; plus the policy: 9 for LRU, 68 for
ARC (resident lists, fingerprints, room for 2c ghosts).

`BlockIndex` (`kvd.core.index.block_index`) changes this state through its
verbs; what is here only reads it, or is the index's own bookkeeping of a slot.
"""

from __future__ import annotations

import sys
from array import array

from kvd.core.index.checks import index_problems
from kvd.core.index.policies import make_policy
from kvd.core.index.policies.arrays import filled, nones
from kvd.core.index.types import Key, OffloadingEvent, ReadySink, SlotSink
from kvd.errors import BadRequest, MissingKey, NotReady


class IndexState:
    """A pool index's slots, keys, states and pins; the verbs are `BlockIndex`'s."""

    def __init__(
        self,
        num_blocks: int,
        policy: str = "lru",
        block_tokens: int = 16,
        *,
        medium: str = "CPU",
        locality: str | None = None,
    ) -> None:
        if num_blocks < 1:
            raise BadRequest(f"num_blocks must be >= 1, got {num_blocks}")
        if block_tokens < 1:
            raise BadRequest(f"block_tokens must be >= 1, got {block_tokens}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.medium = medium  # what its events name: "CPU", or "STORAGE" for a disk tier's
        self.locality = locality
        self._slot_of: dict[Key, int] = {}
        self._slot_of_bytes = sys.getsizeof(self._slot_of)  # its size at the last growth
        self._deleted = 0  # keys deleted from `_slot_of` since its last growth
        self._key_at: list[Key | None] = nones(num_blocks)
        self._ready = bytearray(num_blocks)
        # 64-bit: no number of pins on one block can overflow it.
        self._refs = filled("q", num_blocks)
        self._free = array("i")
        self._held: list[int] = []
        self._next_fresh = 0
        self._num_not_ready = 0
        self._num_pinned = 0
        self._events: list[OffloadingEvent] = []
        self.sink: ReadySink | None = None  # told of every change lookups would see
        self.slot_sink: SlotSink | None = None  # told which slots hold ready blocks (SPEC 13)
        self.policy = make_policy(policy, num_blocks, self._is_ready, self._is_evictable)

    # -- policy callbacks (read-only) -------------------------------------

    def _is_ready(self, slot: int) -> bool:
        return self._ready[slot] == 1

    def _is_evictable(self, slot: int) -> bool:
        return self._ready[slot] == 1 and self._refs[slot] == 0

    # -- read-only views ----------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._free)

    @property
    def num_held(self) -> int:
        """Slots held back after a warm start (`adopt`), until `release_held`."""
        return len(self._held)

    @property
    def num_in_flight(self) -> int:
        return self._num_not_ready

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_ready(self) -> int:
        return len(self._slot_of) - self._num_not_ready

    def slot_of(self, key: Key) -> int | None:
        return self._slot_of.get(key)

    def is_ready(self, key: Key) -> bool:
        slot = self._slot_of.get(key)
        return slot is not None and self._ready[slot] == 1

    def ref_cnt(self, key: Key) -> int:
        slot = self._slot_of.get(key)
        return 0 if slot is None else self._refs[slot]

    def key_at(self, slot: int) -> Key | None:
        """The key held by `slot`, None when the slot is free."""
        return self._key_at[slot]

    @property
    def next_fresh_slot(self) -> int:
        """The lowest slot id never allocated since the last reset (num_blocks: none left)."""
        return self._next_fresh

    @property
    def freed_slots(self) -> tuple[int, ...]:
        """Freed slot ids waiting for reuse; the last one goes first."""
        return tuple(self._free)

    @property
    def pending_events(self) -> tuple[OffloadingEvent, ...]:
        """The events `take_events` would drain now, without draining them."""
        return tuple(self._events)

    def check_invariants(self) -> list[str]:
        """The SPEC section 4 invariants that do not hold (empty when all do). O(n)."""
        return index_problems(self)

    # -- slots ----------------------------------------------------------------

    def _ready_slot(self, key: Key) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            raise MissingKey(f"key {key.hex()} is not in the cache")
        if not self._ready[slot]:
            raise NotReady(f"key {key.hex()} is still being stored")
        return slot

    def _release_slot(self, slot: int) -> None:
        self._key_at[slot] = None
        self._ready[slot] = 0
        self._refs[slot] = 0
        self._free.append(slot)
