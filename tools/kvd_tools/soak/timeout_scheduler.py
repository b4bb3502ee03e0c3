"""Runs in the soak's timeout-scheduler process: a scheduler of the engine whose stores time out.

    harness                          this process                     the daemon (stopped)
      SIGSTOP, Tally.stalled ----->  sees it: store(keys, device
                                     blocks 0..n-1), 300 ms timeout
                                     -> None: no reply in time        Store queued
      SIGCONT                                                          takes it late: prepares
                                                                       slots, pushes a TransferJob
                                                                       to each engine rank
                                     the engine's ranks never start it (the engine never
                                     named it) and refuse it once past its deadline; the
                                     daemon frees its slots

A second `Scheduler` of the TP engine (same engine id, same pool, a short
`timeout_ms`), idle but for one store at the start of each daemon stall, so
that the store is the request the stall catches. It stores keys no one
else stores (`timeout_key`), checked absent beforehand, so that the store
has a job. Its device block ids are
the engine's first blocks in reverse (key i of the chain from block 7 - i),
which the engine overwrites at every step with zeros or other keys' bytes
(an engine step puts key i of a chain in block i): a rank that ran the job
after all would leave those bytes in the keys' slots. So for a while the engine looks up and loads
those keys at every other step (`Tally.set_suspect`), and its ranks check
every block they load: a hit on such a key must hold the key's own bytes
(stored again by the engine once the timed-out job's slots were freed).
Counts: `store_timeouts` (the store returned None because no reply came),
`late_store_answers` (the stall ended first; the job is never named either,
and the ranks refuse it once late).
"""

from __future__ import annotations

import random
import time

from kvd_client import Scheduler
from kvd_client.errors import ErrorCode, KvdError
from kvd_tools.soak.actors import count_failure
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.workload import (
    CAPACITY_BYTES,
    ENGINE_ID,
    MAX_ENGINE_CHAIN,
    POOL,
    TIMEOUT_KEYS,
    layout,
    timeout_key,
)

TIMEOUT_MS = 300  # well inside the shortest stall (1 s)
POLL_S = 0.01
PICK_EVERY_S = 5.0  # rarely: a lookup in flight when a stall begins would spoil its store
# How long the engine keeps loading the store's keys: the stall (at most 3 s), the
# job's deadline after it (3 s in the soak), and as long again.
SUSPECT_S = 12.0


def timeout_scheduler_main(tally: Tally, slot: int, endpoint: str, seed: int) -> None:
    """Process entry point: one store per daemon stall, until the harness sets the stop flag."""
    tally.log_to_file("timeouts")
    scheduler = TimeoutScheduler(tally, slot, endpoint, seed)
    try:
        in_stall = False
        while not tally.stopped:
            if not tally.stalled:
                in_stall = False
                scheduler.pick()
            elif not in_stall:
                in_stall = True
                scheduler.store()
            time.sleep(POLL_S)
    finally:
        scheduler.sched.close()


class TimeoutScheduler:
    def __init__(self, tally: Tally, slot: int, endpoint: str, seed: int) -> None:
        self.tally, self.slot, self.endpoint = tally, slot, endpoint
        self.rng = random.Random(seed)
        self.sched = self._open()
        self.next_first = self.rng.randrange(TIMEOUT_KEYS)
        self.keys = self._chain()
        self.picked_at = 0.0

    def _open(self) -> Scheduler:
        return Scheduler(
            POOL,
            layout(),
            engine_id=ENGINE_ID,
            endpoint=self.endpoint,
            capacity_bytes=CAPACITY_BYTES,
            timeout_ms=TIMEOUT_MS,
        )

    def _chain(self) -> tuple[int, int]:
        """The next chain of timeout keys (they go round)."""
        count = self.rng.randint(1, MAX_ENGINE_CHAIN)
        first, self.next_first = self.next_first, (self.next_first + count) % TIMEOUT_KEYS
        return first, count

    def pick(self) -> None:
        """Between stalls: now and then, checks that the chain the next stall will store is
        absent (so the store has a job); takes the next one if not."""
        now = time.monotonic()
        if now - self.picked_at < PICK_EVERY_S or not self.sched.connected:
            return
        self.picked_at = now
        first, count = self.keys
        self.tally.add(self.slot, "ops")
        if any(self.sched.lookup([timeout_key(first + i)]) for i in range(count)):
            self.keys = self._chain()

    def store(self) -> None:
        """The store the stall catches: no reply within TIMEOUT_MS, so None."""
        connected = self.sched.connected
        if not connected:
            return  # still reconnecting after a restart or the last stall
        first, count = self.keys
        keys = [timeout_key(first + i) for i in range(count)]
        self.tally.add(self.slot, "ops")
        try:
            ticket = self.sched.store(keys, [MAX_ENGINE_CHAIN - 1 - i for i in range(count)])
        except KvdError as exc:
            if exc.code != ErrorCode.WORKERS_MISSING:  # answered: the ranks are restarting
                self._failed(exc)
            return
        except Exception as exc:  # counted, see count_failure
            self._failed(exc)
            return
        if ticket is None and not self.sched.connected:
            self.tally.add(self.slot, "store_timeouts")  # no reply: the socket was dropped
        elif ticket is not None:
            self.tally.add(self.slot, "late_store_answers")
        if ticket is None or ticket.job_id is not None:
            self.tally.set_suspect(first, count, time.monotonic() + SUSPECT_S)
        self.keys = self._chain()

    def _failed(self, exc: Exception) -> None:
        if count_failure(self.tally, self.slot, "timeout scheduler", "store", exc):
            self.sched.close()
            self.sched = self._open()
