"""Runs in the daemon (pure core): the public name `kvd.index.policies` of SPEC section 4.

The policies live in `kvd.core.index.policies`.
"""

from kvd.core.index.policies import (
    POLICIES,
    ARCPolicy,
    CachePolicy,
    GhostLists,
    Key,
    LRUPolicy,
    SlotLists,
    SlotPredicate,
    make_policy,
)

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
