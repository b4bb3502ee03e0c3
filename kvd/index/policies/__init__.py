"""Runs in the daemon (pure core): eviction policies, selectable by name."""

from __future__ import annotations

from kvd.errors import BadRequest
from kvd.index.policies.arc import ARCPolicy
from kvd.index.policies.base import CachePolicy, Key, KeyPredicate
from kvd.index.policies.lru import LRUPolicy

POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(
    name: str, capacity: int, is_ready: KeyPredicate, is_evictable: KeyPredicate
) -> CachePolicy:
    """The policy called `name`; an unknown name is a `BadRequest`."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise BadRequest(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(capacity, is_ready, is_evictable)


__all__ = ["POLICIES", "ARCPolicy", "CachePolicy", "Key", "LRUPolicy", "make_policy"]
