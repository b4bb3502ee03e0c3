"""Runs in the daemon (pure core): the block index and its eviction policies."""

from kvd.core.index.block_index import BlockIndex
from kvd.core.index.types import Key, LoadStoreSpec, OffloadingEvent, PrepareStoreOutput

__all__ = ["BlockIndex", "Key", "LoadStoreSpec", "OffloadingEvent", "PrepareStoreOutput"]
