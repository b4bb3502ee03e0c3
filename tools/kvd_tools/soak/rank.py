"""Runs in an engine rank process of the soak: a `kvd_client.Worker` over a CPU "device" cache.

The engine (`kvd_tools.soak.engine`) sends each step over a pipe; the rank answers:

    ("load", seq, job, loads, fills)  zero the load's device blocks, wait(job),
                                      check every loaded block == content(key, rank),
                                      then fill the missed blocks for the store
                                      -> ("load", seq, ok, blocks verified)
    ("store", seq, job)               wait(job)  -> ("store", seq, ok, 0)
    ("close", seq)                    close the Worker (Goodbye) and exit

Each step starts with `Worker.poll()`, as an engine's per-step poll does.

Load destinations and store sources are disjoint device blocks, and every
job of a step is waited for, so a rank never runs a job of another step
into blocks the engine has reused. A rank whose engine died exits by itself.

The reconnect fault: when the harness arms it (`Tally.arm_reconnect`), the
rank's next store drops its socket and reconnects through the client's own
reconnect step (`Connection.connect`: a new socket, `Hello` with the same
`instance`, `Attach`), so the daemon sees a new session of the same process
take over a job it owes. Mostly after the copy and before the
acknowledgement (the job's new session must answer for it); one time in
four as soon as the step arrives, when the job's push is usually still
unread in the old socket and goes with it (the daemon pushes it again to
the new session: it must run once, or fail cleanly).
While the twin's leave fault is armed the "forward pass" before each job
lasts 200 ms, so that the workers on the other pool leave while a job of
this one is in flight (`kvd_tools.soak.twin`).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from kvd_client.backends import CopyResult
from kvd_client.errors import KvdError
from kvd_client.worker import Worker
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
# ... longer while the twin's workers are to leave: they leave while a job of ours runs.
FORWARD_WHILE_LEAVING_S = 0.2
EARLY_RECONNECTS = 0.25  # of the reconnect faults: before the job's push was read


class SoakWorker(Worker):
    """A `Worker` that can drop its session and reconnect in the middle of a job,
    and counts the jobs it refused unstarted (past their deadline, or abandoned)."""

    reconnect_before_ack: int | None = None  # the job whose acknowledgement waits for one
    late_refusals = 0

    def reconnect(self) -> None:
        """What the keeper thread does after a request timed out, at once: drop the
        socket, say Hello (same `instance`) and attach. Unreachable: the keeper retries."""
        with contextlib.suppress(KvdError):
            self._conn.connect()

    def _finish(self, results: Sequence[CopyResult]) -> None:
        self.late_refusals += sum(1 for r in results if r.error and "not started" in r.error)
        if self.reconnect_before_ack in {r.job_id for r in results}:
            self.reconnect_before_ack = None
            self.reconnect()
        super()._finish(results)


def content(key: int, rank: int) -> Any:
    """The bytes of `rank`'s shard of block `key`: never zero, distinct per key and rank."""
    return block_content(key * WORLD_SIZE + rank, ELEMS)


# -- worker ranks ----------------------------------------------------------------


def worker_main(
    rank: int, tally: Tally, slot: int, endpoint: str, parent: int, wait_s: float, conn: Connection
) -> None:
    """Process entry point of rank `rank`: serves the engine's steps until told to close."""
    tally.log_to_file(f"rank{rank}")
    cache = contiguous_cache(NUM_DEVICE_BLOCKS, SLOT_BYTES, "int64")

    def open_worker() -> SoakWorker:
        return SoakWorker(
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
                refused = worker.late_refusals
                reply = _serve(rank, tally, slot, worker, cache, msg, wait_s)
                tally.add(slot, "late_refusals", worker.late_refusals - refused)
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


def _store(rank: int, tally: Tally, slot: int, worker: SoakWorker, job: int, wait_s: float) -> bool:
    """Waits for store `job`; with the reconnect fault armed, reconnects during it."""
    if not tally.take_reconnect(rank):
        return bool(worker.wait([job], timeout_s=wait_s)[job])
    if random.random() < EARLY_RECONNECTS:
        worker.reconnect()
        tally.add(slot, "reconnects_before_read")
    else:
        worker.reconnect_before_ack = job
    ok = worker.wait([job], timeout_s=wait_s)[job]
    if worker.reconnect_before_ack is None:
        tally.add(slot, "worker_reconnects")
    else:  # the job never came (its push was lost): the next store reconnects instead
        worker.reconnect_before_ack = None
        tally.arm_reconnect(rank)
    return bool(ok)


def _serve(
    rank: int, tally: Tally, slot: int, worker: SoakWorker, cache: Any, msg: Any, wait_s: float
) -> tuple[str, int, bool | None, int]:
    import torch

    kind, seq, job = msg[0], msg[1], msg[2]
    # Each step polls, as an engine's worker does once per step: it acknowledges
    # whatever finished, and refuses what arrived unnamed and is now past its deadline.
    worker.poll()
    # The "forward pass": a job stays in flight a while, so kills land mid-job.
    time.sleep(FORWARD_WHILE_LEAVING_S if tally.leave_armed else random.uniform(0.0, FORWARD_S))
    if kind == "store":
        return (kind, seq, _store(rank, tally, slot, worker, job, wait_s), 0)
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
