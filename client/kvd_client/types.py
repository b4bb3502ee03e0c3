"""Runs in every kvd process: the value types of the index verbs, shared by daemon and client.

`kvd.core.index` returns them and `kvd_client.Scheduler` returns the same ones, so
engine code reads the same shapes in process and out of process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Key = bytes
# What a transfer job does: the daemon's job table, the wire and the copy planner
# all spell it with this one type.
JobKind = Literal["store", "load"]
JOB_KINDS: tuple[JobKind, ...] = ("store", "load")


@dataclass(frozen=True, slots=True)
class LoadStoreSpec:
    """Slot ids in the pool, in the order of the keys they answer."""

    slots: list[int]


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What `prepare_store` allocated: store `keys_to_store` into `store_spec.slots`."""

    keys_to_store: list[Key]
    store_spec: LoadStoreSpec
    evicted_keys: list[Key] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Blocks that became loadable (`removed=False`) or left the cache (`removed=True`)."""

    keys: list[Key]
    block_tokens: int
    medium: str = "CPU"
    removed: bool = False
    locality: str | None = None  # "LOCAL" for a disk tier's, as vLLM's fs tier says


@dataclass(frozen=True, slots=True)
class StoreTicket:
    """`Scheduler.store`: `job_id` is None when every key was already stored."""

    job_id: int | None
    keys_to_store: list[Key]
    evicted_keys: list[Key]
