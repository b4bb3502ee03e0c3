"""Runs in the daemon (pure core): the block index's checks, its invariants and an adoption's input.

`BlockIndex.check_invariants` answers with `index_problems` (SPEC section 4),
and `BlockIndex.adopt` takes its state from `adoption` (SPEC 13), kept
apart from the index's verbs. `index_problems` reads the index's private
arrays: it is the index's own check, in a module of its own for its size.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvd.core.index.types import Key
from kvd.errors import BadRequest

if TYPE_CHECKING:
    from kvd.core.index.index_state import IndexState


def index_problems(index: IndexState) -> list[str]:
    """The invariants that do not hold (empty when all do). O(n)."""
    problems: list[str] = []
    allocated = len(index._slot_of)
    if index.num_free + allocated + index.num_held != index.num_blocks:
        problems.append(
            f"free {index.num_free} + allocated {allocated} + held {index.num_held} "
            f"!= num_blocks {index.num_blocks}"
        )
    slots = list(index._slot_of.values())
    if len(set(slots)) != len(slots):
        problems.append("a slot is held by two keys")
    free = set(index._free)
    if len(free) != len(index._free) or any(s >= index._next_fresh for s in free):
        problems.append("free list holds a duplicate or never-allocated slot")
    if free & set(slots):
        problems.append("a free slot is also allocated")
    held = set(index._held)
    if len(held) != len(index._held) or held & (free | set(slots)):
        problems.append("a held slot is held twice, free or allocated")
    for key, slot in index._slot_of.items():
        if index._key_at[slot] != key:
            problems.append(f"slot {slot} does not point back at its key")
            break
    if any(r < 0 for r in index._refs):
        problems.append("negative ref_cnt")
    not_ready = sum(1 for s in slots if not index._ready[s])
    if not_ready != index._num_not_ready:
        problems.append(f"in-flight count {index._num_not_ready} != actual {not_ready}")
    pinned = sum(1 for s in slots if index._refs[s] > 0)
    if pinned != index._num_pinned or pinned != sum(1 for r in index._refs if r > 0):
        problems.append(f"pinned count {index._num_pinned} != actual {pinned}")
    if sum(1 for key in index._key_at if key is not None) != allocated:
        problems.append("a free slot still names a key")
    policy_slots = list(index.policy.slots())
    if len(policy_slots) != len(index.policy) or sorted(policy_slots) != sorted(slots):
        problems.append("resident slots of the policy != slots of the index")
    elif not all(index.policy.get(slot) for slot in slots):
        problems.append("the policy denies a resident slot")
    problems.extend(index.policy.check_invariants())
    return problems


KEY_LENGTHS = frozenset(range(1, 65))


class Adoption(NamedTuple):
    """An empty index's state once it adopted `keys[i]` in `slots[i]`."""

    slot_of: dict[Key, int]
    key_at: list[Key | None]
    ready: bytearray
    free: array[int]  # every other slot, a LIFO stack: the lowest goes first


def adoption(
    num_blocks: int,
    slots: Sequence[int],
    keys: Sequence[Key],
    slot_of: dict[Key, int] | None,
    held: Sequence[int] = (),
) -> Adoption:
    """The state of an adoption (SPEC 13); `BadRequest` unless the slots and the
    keys are distinct, the slots in range, the keys 1 to 64 bytes and the
    `held` slots (left out of the free list) in range and none of `slots`. A
    million blocks take a few C-level passes and one Python loop. `slot_of`:
    dict(zip(keys, slots)) where the caller has it (the C scan builds it with
    the keys, which it checked); its keys are not checked again."""
    if len(slots) != len(keys):
        raise BadRequest(f"adopt: {len(slots)} slots for {len(keys)} keys")
    if slots and not (min(slots) >= 0 and max(slots) < num_blocks):
        raise BadRequest(f"adopt: a slot outside 0..{num_blocks - 1}")
    if slot_of is None:
        if keys and (set(map(type, keys)) != {bytes} or not set(map(len, keys)) <= KEY_LENGTHS):
            raise BadRequest("adopt: keys must be 1 to 64 bytes")
        slot_of = dict(zip(keys, slots, strict=True))
    elif keys and (slot_of.get(keys[0]) != slots[0] or slot_of.get(keys[-1]) != slots[-1]):
        raise BadRequest("adopt: the map given is not the keys' and the slots'")
    key_at: list[Key | None] = [None] * num_blocks
    ready = bytearray(num_blocks)
    for slot, key in zip(slots, keys, strict=True):
        key_at[slot] = key
        ready[slot] = 1
    if len(slot_of) != len(keys) or ready.count(1) != len(slots):
        raise BadRequest("adopt: a slot or a key appears twice")
    taken = ready
    if held:
        if not all(0 <= s < num_blocks and not ready[s] for s in held):
            raise BadRequest("adopt: a held slot outside the table or holding a block")
        taken = bytearray(ready)
        for s in held:
            taken[s] = 1
    # Free slots go lowest first, as fresh ones would.
    free, at = [], taken.find(0)
    while at >= 0:
        free.append(at)
        at = taken.find(0, at + 1)
    return Adoption(slot_of, key_at, ready, array("i", free[::-1]))
