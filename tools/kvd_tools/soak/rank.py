"""Runs in an engine rank process of the soak: a `kvd_client.Worker` over a CPU "device" cache.

The engine (`kvd_tools.soak.engine`) sends each step over a pipe; the rank answers:

    ("load", seq, job, loads, fills)  zero the load's device blocks, wait(job),
                                      check every loaded block == content(key, rank),
                                      then fill the missed blocks for the store
                                      -> ("load", seq, ok, blocks verified)
    ("store", seq, job)               wait(job)  -> ("store", seq, ok, 0)
    ("close", seq)                    close the Worker (Goodbye) and exit

Load destinations and store sources are disjoint device blocks, and every
job of a step is waited for, so a rank never runs a job of another step
into blocks the engine has reused. A rank whose engine died exits by itself.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from kvd_tools.harness import block_content, commands, content_tag, contiguous_cache
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.workload import (
    ELEMS,
    ENGINE_ID,
    NUM_DEVICE_BLOCKS,
    POOL,
    SLOT_BYTES,
    WORLD_SIZE,
    layout,
)

# The "forward pass" before each job: it stays in flight a while, so kills land mid-job.
FORWARD_S = 0.005


def content(key: int, rank: int) -> Any:
    """The bytes of `rank`'s shard of block `key`: never zero, distinct per key and rank."""
    return block_content(key * WORLD_SIZE + rank, ELEMS)


# -- worker ranks ----------------------------------------------------------------


def worker_main(
    rank: int, tally: Tally, slot: int, endpoint: str, parent: int, wait_s: float, conn: Connection
) -> None:
    """Process entry point of rank `rank`: serves the engine's steps until told to close."""
    from kvd_client import Worker

    tally.log_to_file(f"rank{rank}")
    cache = contiguous_cache(NUM_DEVICE_BLOCKS, SLOT_BYTES, "int64")

    def open_worker() -> Worker:
        return Worker(
            rank,
            WORLD_SIZE,
            cache,
            pool=POOL,
            layout=layout(),
            engine_id=ENGINE_ID,
            endpoint=endpoint,
            timeout_ms=1000,
        )

    worker = open_worker()
    try:
        conn.send(("ready", -1, os.getpid()))
        for msg in commands(conn, parent):  # ends when the engine dies; so does its rank
            if msg[0] == "close":
                return
            try:
                reply = _serve(rank, tally, slot, worker, cache, msg, wait_s)
            except Exception:  # the library broke a promise: count it, re-create it
                tally.violation(slot, f"rank {rank} crashed: {traceback.format_exc(limit=4)!r}")
                tally.add(slot, "recreated")
                worker.close()
                worker = open_worker()
                reply = (msg[0], msg[1], False, 0)
            conn.send(reply)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the engine died; so does its rank
    finally:
        worker.close()


def _serve(
    rank: int, tally: Tally, slot: int, worker: Any, cache: Any, msg: Any, wait_s: float
) -> tuple[str, int, bool | None, int]:
    import torch

    kind, seq, job = msg[0], msg[1], msg[2]
    # The "forward pass": a job stays in flight a while, so kills land mid-job.
    time.sleep(random.uniform(0.0, FORWARD_S))
    if kind == "store":
        ok = worker.wait([job], timeout_s=wait_s)[job]
        return (kind, seq, ok, 0)
    loads, fills = msg[3], msg[4]
    ok, verified = None, 0
    if job is not None:
        for dev, _ in loads:
            cache[dev].zero_()
        ok = worker.wait([job], timeout_s=wait_s)[job]
        if ok:
            tally.add(slot, "loads")
            for dev, key in loads:
                got = cache[dev]
                if not torch.equal(got, content(key, rank)):
                    tally.violation(
                        slot,
                        f"rank {rank} job {job}: block of key {key} holds other bytes "
                        f"(first element {int(got[0])}: "
                        f"key*{WORLD_SIZE}+rank = {content_tag(got):g})",
                    )
                verified += 1
            tally.add(slot, "blocks_verified", verified)
        else:
            tally.add(slot, "failed_jobs")
    for dev, key in fills:
        cache[dev].copy_(content(key, rank))
    return (kind, seq, ok, verified)
