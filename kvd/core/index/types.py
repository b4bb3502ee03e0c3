"""Runs in the daemon (pure core): the value types the block index returns, and its ready sink.

The value types are defined once in `kvd_client.types`, so the client's verbs
return the same ones.
"""

from collections.abc import Sequence
from typing import Protocol

from kvd_client.types import Key, LoadStoreSpec, OffloadingEvent, PrepareStoreOutput

__all__ = [
    "Key",
    "LoadStoreSpec",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "ReadySink",
    "SlotSink",
]


class ReadySink(Protocol):
    """Told of every change of what `BlockIndex.lookup` would answer, as it happens
    (the daemon's shared-memory ready table, SPEC section 15)."""

    def storing(self, keys: Sequence[Key]) -> None: ...
    def ready(self, keys: Sequence[Key]) -> None: ...
    def gone(self, keys: Sequence[Key]) -> None: ...
    def reset(self) -> None: ...
    def adopted(self, keys: Sequence[Key]) -> None:
        """`keys` are ready in an index that was empty (`BlockIndex.adopt`)."""


class SlotSink(Protocol):
    """Told what each slot holds, as it changes (the pool segment's slot table,
    SPEC section 13), so that a daemon started after this one knows which slots
    a job of this one may still touch: `storing` when slots are handed to a
    store (a ready victim's too: its slot leaves the ready set with it),
    `ready` when a store completes, `freed` when a failed store's slots are
    free again (no rank copies it any more), `pinned` when ready blocks get
    their first load reference, `unpinned` when they lose their last,
    `reset` when the index is emptied."""

    def storing(self, slots: Sequence[int]) -> None: ...
    def ready(self, slots: Sequence[int], keys: Sequence[Key]) -> None: ...
    def freed(self, slots: Sequence[int]) -> None: ...
    def pinned(self, slots: Sequence[int]) -> None: ...
    def unpinned(self, slots: Sequence[int]) -> None: ...
    def reset(self) -> None: ...
