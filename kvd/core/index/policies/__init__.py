"""Runs in the daemon (pure core): eviction policies, selectable by name.

Each policy implements `CachePolicy` (see its docstrings for the contract) on
slot ids; `SlotLists` and `GhostLists` are the flat-array building blocks.
A new policy is one module here and one entry in `POLICIES`. `adoption.py`
is not a policy but a stage in front of one: a warm restart's blocks taught
to the pool's policy a slice at a time (`AdoptingPolicy`).
"""

from __future__ import annotations

from kvd.core.index.policies.adaptive import AdaptivePolicy
from kvd.core.index.policies.arc import ARCPolicy
from kvd.core.index.policies.base import CachePolicy, Key, SlotPredicate
from kvd.core.index.policies.ghosts import GhostLists
from kvd.core.index.policies.lru import LRUPolicy
from kvd.core.index.policies.slot_lists import SlotLists
from kvd.errors import BadRequest

POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "adaptive": AdaptivePolicy,
}


def make_policy(
    name: str, capacity: int, is_ready: SlotPredicate, is_evictable: SlotPredicate
) -> CachePolicy:
    """The policy called `name` over slots `0..capacity-1`; an unknown name is a `BadRequest`."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise BadRequest(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(capacity, is_ready, is_evictable)


__all__ = [
    "POLICIES",
    "ARCPolicy",
    "CachePolicy",
    "GhostLists",
    "Key",
    "LRUPolicy",
    "SlotLists",
    "SlotPredicate",
    "make_policy",
]
