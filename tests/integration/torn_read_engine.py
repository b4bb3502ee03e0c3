"""Runs in a spawned test process: one TP=1 engine that stores, evicts and loads with checksums.

Every block's content is a function of its key, so a load that returns any
other bytes (a torn or reused slot) is a violation. Prints one JSON line of
counts at the end.

    torn_read_engine.py ENDPOINT ENGINE SECONDS SEED [RECORD [KEY_BASE [FORWARD_MS]]]

With RECORD, the engine appends what it knows of its stores to that file, one
JSON object a line, each line written whole before the step it names (so a
SIGKILL or SIGSTOP at any point leaves a record the daemon is never ahead of):

    {"prepare": [keys]}                      a store is about to be asked for
    {"ticket": job, "keys": [..], "evicted": [..]}   its answer (job null: nothing new)
    {"none": true, "connected": bool}        store answered None: nothing fit, or (not
                                             connected) the call never got through
    {"acked": [jobs]}                        the worker is about to acknowledge these
                                             jobs ok to the daemon (`JobDone`)
    {"result": job, "ok": bool}              a store job's result, as the scheduler got it

Keys are ints (sent as 8-byte big-endian); the engine uses KEY_BASE..KEY_BASE+315.
FORWARD_MS stands for a forward pass between a store's ticket and the worker's
copy (SPEC 5: a store reads device memory only after the forward pass).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Sequence

import torch

from kvd_client import Layout, Scheduler, Worker
from kvd_client import protocol as p
from kvd_client.backends import CopyResult
from kvd_client.connection import Connection
from kvd_client.errors import MissingKey, NotReady, Unavailable, WorkersMissing
from kvd_tools.harness import block_content, contiguous_cache

SLOT_BYTES = 16 << 10
ELEMS = SLOT_BYTES // 8


def content(key: int) -> torch.Tensor:
    return block_content(key, ELEMS)


class Record:
    """Appends whole lines to a file (one write each), or nothing without a path."""

    def __init__(self, path: str | None) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else None

    def __call__(self, **entry: object) -> None:
        if self.fd is not None:
            os.write(self.fd, (json.dumps(entry) + "\n").encode())


class RecordingWorker(Worker):
    """A worker that records the jobs it acknowledges ok before it sends the
    acknowledgement: the daemon cannot mark a block ready that is not recorded."""

    record: Record

    def _send(self, conn: Connection, results: Sequence[CopyResult]) -> None:
        self.record(acked=[r.job_id for r in results if r.ok])
        super()._send(conn, results)


def as_int(key: bytes) -> int:
    return int.from_bytes(key, "big")


def main(
    endpoint: str,
    engine: str,
    seconds: float,
    seed: int,
    record_path: str | None = None,
    key_base: int = 0,
    forward_ms: float = 0.0,
) -> None:
    layout = Layout("torn-model", "int64", 16, 1, False, SLOT_BYTES)
    cache = contiguous_cache(64, SLOT_BYTES, "int64")
    rng = random.Random(seed)
    record = Record(record_path)
    stats = {
        "loads": 0,  # load jobs that completed ok
        "blocks_verified": 0,
        "stores": 0,  # store jobs started
        "stores_ok": 0,  # store jobs the scheduler got ok
        "violations": 0,
        "failed_jobs": 0,  # load jobs that failed
        "failed_stores": 0,  # store jobs that failed (worker or scheduler)
        "unfinished_stores": 0,  # store jobs with no result at the end
        "lookup_races": 0,
        "refused": 0,  # loads and stores refused while a lost session came back
    }
    pending_stores: set[int] = set()
    results: dict[int, p.JobResult] = {}

    def collect(s: Scheduler) -> None:
        """Takes what finished: store results are counted here, the rest kept."""
        for r in s.finished():
            if r.job_id in pending_stores:
                pending_stores.discard(r.job_id)
                record(result=r.job_id, ok=r.ok)
                stats["stores_ok" if r.ok else "failed_stores"] += 1
            else:
                results[r.job_id] = r

    def result_of(s: Scheduler, job: int) -> p.JobResult | None:
        deadline = time.monotonic() + 10
        while job not in results and time.monotonic() < deadline:
            collect(s)
            if job not in results:
                time.sleep(0.001)
        return results.pop(job, None)

    RecordingWorker.record = record
    with (
        Scheduler(
            "torn", layout, engine_id=engine, endpoint=endpoint, capacity_bytes=48 * SLOT_BYTES
        ) as s,
        RecordingWorker(
            0, 1, cache, pool="torn", layout=layout, engine_id=engine, endpoint=endpoint
        ) as w,
    ):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            first = key_base + rng.randrange(0, 300)
            keys = list(range(first, first + rng.randint(1, 16)))
            hits = s.lookup(keys)
            if hits is None:
                continue
            if hits:
                cache[:hits].zero_()
                try:
                    job = s.load(keys[:hits], list(range(hits)))
                except (MissingKey, NotReady):
                    # Another engine evicted (or is re-storing) a block since the
                    # lookup: in a shared cache that is a miss, not an error.
                    stats["lookup_races"] += 1
                    continue
                except (Unavailable, WorkersMissing):
                    # The session was lost (a lease missed on a loaded machine)
                    # and is coming back: the engine recomputes.
                    stats["refused"] += 1
                    continue
                ok = w.wait([job])[job]
                result = result_of(s, job)
                if ok and result is not None and result.ok:
                    stats["loads"] += 1
                    for i, key in enumerate(keys[:hits]):
                        if not torch.equal(cache[i], content(key)):
                            stats["violations"] += 1
                        stats["blocks_verified"] += 1
                else:
                    stats["failed_jobs"] += 1
            misses = keys[hits:]
            for i, key in enumerate(misses):
                cache[hits + i] = content(key)
            record(prepare=misses)
            try:
                ticket = s.store(misses, list(range(hits, hits + len(misses))))
            except WorkersMissing:  # as above: the worker is registering again
                stats["refused"] += 1
                ticket = None
            if ticket is None:
                record(none=True, connected=s.connected)
            else:
                record(
                    ticket=ticket.job_id,
                    keys=[as_int(k) for k in ticket.keys_to_store],
                    evicted=[as_int(k) for k in ticket.evicted_keys],
                )
            if ticket is not None and ticket.job_id is not None:
                stats["stores"] += 1
                pending_stores.add(ticket.job_id)
                if forward_ms:
                    time.sleep(forward_ms / 1000)
                w.wait([ticket.job_id])  # not ok: so is its result, counted there
            collect(s)
        end = time.monotonic() + 10
        while pending_stores and time.monotonic() < end:
            collect(s)
            time.sleep(0.01)
        stats["unfinished_stores"] = len(pending_stores)
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0],
        args[1],
        float(args[2]),
        int(args[3]),
        args[4] if len(args) > 4 and args[4] else None,
        int(args[5]) if len(args) > 5 else 0,
        float(args[6]) if len(args) > 6 else 0.0,
    )
