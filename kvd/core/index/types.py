"""Runs in the daemon (pure core): the value types the block index returns.

Defined once in `kvd_client.types`, so the client's verbs return the same ones.
"""

from kvd_client.types import Key, LoadStoreSpec, OffloadingEvent, PrepareStoreOutput

__all__ = ["Key", "LoadStoreSpec", "OffloadingEvent", "PrepareStoreOutput"]
