"""Runs in the soak's twin process: the TP engine's id on a second pool, with both its ranks.

    twin process                                   kvd daemon
      Scheduler(TWIN_POOL, engine_id=ENGINE_ID)    pool "soak-twin": ranks 0 and 1 of the
      Worker(0), Worker(1) on TWIN_POOL            engine are these two sessions; on pool
                                                   "soak" they are the engine's rank processes
      step: lookup, load(hits) -> each Worker.wait, check every loaded block byte for byte,
            fill the misses, store(misses) -> each Worker.wait

A daemon that matched a job's ranks by engine and rank rather than by the
session it was pushed to would let a worker of one pool answer for, or
fail, the other pool's jobs. The leave fault (`Tally.arm_leave`): the twin
waits until a job of the TP engine is in flight (`Tally.engine_job`; the
engine's ranks hold their jobs a little longer while the fault is armed),
closes both its workers (Goodbye) at once, counts whether that job was
still in flight, steps on without them (its loads and stores get WORKERS_MISSING)
and opens them again 0.2 to 1.5 s later. The harness SIGKILLs the whole twin
too (its sessions then end by lease expiry). Either way the TP engine's jobs
must go on (`kvd_tools.soak.engine` checks that no job every rank acked is
failed for a rank that "went away").
"""

from __future__ import annotations

import random
import time
from typing import Any

from kvd_client import Scheduler, Worker
from kvd_client.errors import ErrorCode, KvdError, MissingKey, NotReady
from kvd_tools.harness import block_content, contiguous_cache
from kvd_tools.soak.actors import SESSION_LOST, count_failure
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.workload import (
    ELEMS,
    ENGINE_ID,
    MAX_ENGINE_CHAIN,
    NUM_DEVICE_BLOCKS,
    SLOT_BYTES,
    TWIN_CAPACITY_BYTES,
    TWIN_KEYS,
    TWIN_POOL,
    TWIN_TAG,
    WORLD_SIZE,
    key_number,
    layout,
    twin_key,
)

PAUSE_S = 0.01  # between steps: the twin is company for the engine, not a load of its own
AWAY_S = (0.2, 1.5)
WAIT_FOR_ENGINE_JOB_S = 15.0


def twin_content(key: int, rank: int) -> Any:
    """The bytes of `rank`'s shard of twin block `key`: unlike any engine block's."""
    return block_content((TWIN_TAG + key) * WORLD_SIZE + rank, ELEMS)


def twin_main(tally: Tally, slot: int, endpoint: str, seed: int, wait_s: float) -> None:
    """Process entry point: steps until the harness sets the stop flag (or kills it)."""
    tally.log_to_file("twin")
    twin = Twin(tally, slot, endpoint, seed, wait_s)
    try:
        while not tally.stopped:
            twin.step()
            time.sleep(PAUSE_S)
    finally:
        twin.close()


class Twin:
    def __init__(self, tally: Tally, slot: int, endpoint: str, seed: int, wait_s: float) -> None:
        self.tally, self.slot, self.endpoint = tally, slot, endpoint
        self.rng = random.Random(seed)
        self.wait_s = wait_s
        self.call = ""
        self.caches = [
            contiguous_cache(NUM_DEVICE_BLOCKS, SLOT_BYTES, "int64") for _ in range(WORLD_SIZE)
        ]
        self.workers: list[Worker] = []
        self.back_at = 0.0
        self.sched = self._open()

    def _open(self) -> Scheduler:
        return Scheduler(
            TWIN_POOL,
            layout(),
            engine_id=ENGINE_ID,
            endpoint=self.endpoint,
            capacity_bytes=TWIN_CAPACITY_BYTES,
            timeout_ms=1000,
        )

    def _open_workers(self) -> None:
        self.workers = [
            Worker(
                r, WORLD_SIZE, self.caches[r], pool=TWIN_POOL, layout=layout(),
                engine_id=ENGINE_ID, endpoint=self.endpoint, timeout_ms=1000,
            )
            for r in range(WORLD_SIZE)
        ]  # fmt: skip

    def _close_workers(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []

    def close(self) -> None:
        self._close_workers()
        self.sched.close()

    def step(self) -> None:
        if self.workers and self.tally.leave_armed:
            self._leave()
        if not self.workers and time.monotonic() >= self.back_at:
            self._open_workers()
        self.call = "step"
        try:
            self._step()
        except Exception as exc:  # a client call raised: counted, see count_failure
            if count_failure(self.tally, self.slot, "twin", self.call, exc):
                self.sched.close()
                self.sched = self._open()

    def _leave(self) -> None:
        """Both workers say goodbye while a job of the TP engine (the other pool) runs,
        or without one if none came for a while (the engine was restarting)."""
        deadline = time.monotonic() + WAIT_FOR_ENGINE_JOB_S
        while not self.tally.engine_job and time.monotonic() < deadline:
            if self.tally.stopped:
                return
            time.sleep(0.001)
        job = self.tally.engine_job
        self._close_workers()
        self.tally.clear_leave()
        self.tally.add(self.slot, "second_pool_leaves")
        if job and self.tally.engine_job == job:  # both goodbyes came while it ran
            self.tally.add(self.slot, "leaves_during_job")
        self.back_at = time.monotonic() + self.rng.uniform(*AWAY_S)

    def _step(self) -> None:
        s, add = self.sched, self.tally.add
        first = self.rng.randrange(TWIN_KEYS)
        keys = [twin_key(first + i) for i in range(self.rng.randint(1, MAX_ENGINE_CHAIN))]
        add(self.slot, "ops")
        self.call = "lookup"
        hits = s.lookup(keys)
        if hits is None:
            return  # a store of one of them is in flight
        if hits:
            hits = self._load(keys[:hits])
        for r, cache in enumerate(self.caches):
            for i, k in enumerate(keys[hits:]):
                cache[hits + i].copy_(twin_content(key_number(k), r))
        add(self.slot, "ops")
        self.call = "store"
        try:
            ticket = s.store(keys[hits:], list(range(hits, len(keys))))
        except KvdError as exc:
            if exc.code != ErrorCode.WORKERS_MISSING:
                raise
            return
        if ticket is None or ticket.job_id is None:
            return
        if self._wait(ticket.job_id):
            add(self.slot, "stores")

    def _load(self, keys: list[bytes]) -> int:
        """Loads `keys` into device blocks 0.. and checks them; how many are now loaded."""
        import torch

        self.tally.add(self.slot, "ops")
        self.call = "load"
        try:
            job = self.sched.load(keys, list(range(len(keys))))
        except (MissingKey, NotReady):
            self.tally.add(self.slot, "races")
            return 0
        except KvdError as exc:
            if exc.code != ErrorCode.WORKERS_MISSING and exc.code not in SESSION_LOST:
                self.tally.violation(self.slot, f"twin: load raised {exc}")
            return 0
        for cache in self.caches:
            cache[: len(keys)].zero_()
        if not self._wait(job):
            return 0
        self.tally.add(self.slot, "loads")
        for r, cache in enumerate(self.caches):
            for i, k in enumerate(keys):
                if not torch.equal(cache[i], twin_content(key_number(k), r)):
                    self.tally.violation(
                        self.slot,
                        f"twin: rank {r} job {job}: block of key {key_number(k)} holds "
                        f"other bytes (first element {int(cache[i][0])})",
                    )
        self.tally.add(self.slot, "blocks_verified", len(keys) * WORLD_SIZE)
        return len(keys)

    def _wait(self, job: int) -> bool:
        """Each worker's copy of `job`; True when every rank's succeeded."""
        workers = self.workers
        oks = [w.wait([job], timeout_s=self.wait_s)[job] for w in workers]
        if len(oks) == WORLD_SIZE and all(oks):
            return True
        self.tally.add(self.slot, "failed_jobs")
        return False
