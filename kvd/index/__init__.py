"""Runs in the daemon (pure core): the public name `kvd.index` of SPEC section 4.

The index lives in `kvd.core.index`; this package keeps the name that engines
and tools import (`from kvd.index import BlockIndex`).
"""

from kvd.core.index import BlockIndex, Key, LoadStoreSpec, OffloadingEvent, PrepareStoreOutput

__all__ = ["BlockIndex", "Key", "LoadStoreSpec", "OffloadingEvent", "PrepareStoreOutput"]
