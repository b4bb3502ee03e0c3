"""Runs in vLLM's scheduler process: what `KvdOffloadingManager` keeps per store and per lookup.

`Store`: one `prepare_store` in flight, matched to vLLM's completion by its
request and keys. `Request`: one lookup of one KV cache group of a request
(its keys in the order vLLM's scan reads them, the hits, their pins). `Pin`:
a slot pinned for a load, with the segment and session that hold it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Store:
    """One `prepare_store` in flight; vLLM completes it by its request and keys."""

    token: int
    keys: list[bytes]  # keys_to_store, in the order of their slots
    session: int  # the `Scheduler.epoch` it was prepared in
    deadline: float  # its spec's
    writers: int  # workers that copy it (under MLA the others acknowledge only)
    reports: int = 0  # workers that reported their copy
    copied: bool = True  # every report so far said copied


@dataclass
class Pin:
    slot: int
    generation: int  # of the pool's segment the slot is in
    session: int | None  # the `Scheduler.epoch` of the session holding the pin


@dataclass
class Request:
    """What one request's last lookup found: the keys sent (in prefix order,
    from the first one vLLM asked about) and the pinned leading hits."""

    keys: list[bytes]
    registered: int  # keys vLLM had registered for the request then
    step: int  # the scheduler step of that lookup
    hits: int | None = 0  # None: a key is being stored, look again next step
    failed: bool = False  # the daemon did not answer: look again next step
    from_table: bool = False  # answered from the ready table: hits not pinned yet
    pinned: dict[bytes, Pin] = field(default_factory=dict)
    index: dict[bytes, int] = field(default_factory=dict)  # key -> its place in keys (RPC)
    # From the ready table: the leading hits (keys[:hits]); None otherwise, or
    # while a key is being stored (hits None).
    hit_keys: frozenset[bytes] | None = None
    # Monotonic time of the first of the lookups in a row that answered RETRY.
    retry_since: float | None = None
    # A window group's: every key looked up this step (the hits and the miss
    # that ended each run); vLLM's scan back goes on past a miss, and a key
    # beyond those is looked up then (`_scan_on`), without the ready table in
    # `scan_trips` more round trips at most.
    scanned: set[bytes] | None = None
    scan_trips: int = 0
