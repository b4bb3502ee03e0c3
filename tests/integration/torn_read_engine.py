"""Runs in a spawned test process: one TP=1 engine that stores, evicts and loads with checksums.

Every block's content is a function of its key, so a load that returns any
other bytes (a torn or reused slot) is a violation. Prints one JSON line.
"""

from __future__ import annotations

import json
import random
import sys
import time

import torch

from kvd_client import Layout, Scheduler, Worker
from kvd_client.errors import MissingKey, NotReady
from kvd_tools.harness import block_content, contiguous_cache

SLOT_BYTES = 16 << 10
ELEMS = SLOT_BYTES // 8


def content(key: int) -> torch.Tensor:
    return block_content(key, ELEMS)


def main(endpoint: str, engine: str, seconds: float, seed: int) -> None:
    layout = Layout("torn-model", "int64", 16, 1, False, SLOT_BYTES)
    cache = contiguous_cache(64, SLOT_BYTES, "int64")
    rng = random.Random(seed)
    stats = {
        "loads": 0,
        "blocks_verified": 0,
        "stores": 0,
        "violations": 0,
        "failed_jobs": 0,
        "lookup_races": 0,
    }
    with (
        Scheduler(
            "torn", layout, engine_id=engine, endpoint=endpoint, capacity_bytes=48 * SLOT_BYTES
        ) as s,
        Worker(0, 1, cache, pool="torn", layout=layout, engine_id=engine, endpoint=endpoint) as w,
    ):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            first = rng.randrange(0, 300)
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
                ok = w.wait([job])[job]
                result = next(r for r in s.finished() if r.job_id == job)
                if ok and result.ok:
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
            ticket = s.store(misses, list(range(hits, hits + len(misses))))
            if ticket is not None and ticket.job_id is not None:
                w.wait([ticket.job_id])
                stats["stores"] += 1
            s.finished()
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
