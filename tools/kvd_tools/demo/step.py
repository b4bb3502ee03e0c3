"""Runs in the demo's scheduler and its TP workers: the per-step messages between them.

The engine's own channel (a multiprocessing pipe per worker; these processes
are all the demo's, so pickling is fine here and never touches the kvd wire).
It carries the kvd job ids of each step, so a worker knows which transfer to
wait for and when:

    scheduler                                   worker rank r
      Forward(tokens, start, table, load_job) ->  wait(load_job), agree with the
                                                  other ranks, forward pass
                                              <-  Output(logits on rank 0, start)
      Scheduler.store(new full blocks)
      Forward(..., store_job) or Release(store_job)
                                              ->  wait(store_job): the copy reads
                                                  blocks the earlier pass wrote
                                              <-  Output / Released
      (device blocks are reused only after the store finished)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvd_client.protocol import Layout
from kvd_tools.demo.model import ModelConfig


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a TP worker needs to start: its model shard, KV cache, kvd pool and peers."""

    config: ModelConfig
    world_size: int
    num_device_blocks: int
    pool: str
    layout: Layout
    engine_id: str
    endpoint: str
    init_method: str  # torch.distributed rendezvous (file://...)


@dataclass(frozen=True, slots=True)
class Forward:
    """Run positions start..len(tokens) over the blocks of `block_table`.

    `tokens` holds the whole sequence from position 0, so a worker can fall
    back to recomputing everything when `load_job` (positions before `start`)
    failed. `store_job`, when set, stores blocks an earlier step wrote.
    """

    tokens: list[int]
    start: int
    block_table: list[int]
    load_job: int | None = None
    store_job: int | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """The request is over: finish `store_job` (if any) and answer `Released`."""

    store_job: int | None


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Tells a worker to leave its loop and exit."""


Command = Forward | Release | Shutdown


@dataclass(frozen=True, slots=True)
class Ready:
    rank: int
    connected: bool


@dataclass(frozen=True, slots=True)
class Output:
    """A forward pass done: the last position's logits (rank 0 only), where it started."""

    rank: int
    logits: npt.NDArray[np.float32] | None
    start: int
    load_ok: bool | None


@dataclass(frozen=True, slots=True)
class Released:
    rank: int
    store_ok: bool | None


@dataclass(frozen=True, slots=True)
class Failed:
    rank: int
    error: str


Answer = Ready | Output | Released | Failed
