"""Runs in the soak's engine process: the scheduler of one TP=2 engine, keeper of its ranks.

    engine process (Scheduler)              rank process r (kvd_tools.soak.rank)
      lookup, load(hits)         -- load -->  zero the load's device blocks, wait(load job),
                                              check each loaded block == content(key, r),
                                              fill the missed blocks with content(key, r)
                                 <-- ok ---
      store(misses)              -- store ->  wait(store job)
                                 <-- ok ---

Every block's bytes are a function of its key and the rank holding the shard,
so a load that returns anything else (a torn or reused slot, another rank's
shard, a stale generation) is a violation, counted in the worker that saw it.
A load counts only when the rank's own copy succeeded; the daemon reporting
ok for a job a rank failed is a violation too. So is the daemon failing a job
because a rank "went away" when every rank acknowledged it and no fault that
ends sessions (a daemon stall or restart, `Tally.excused`) was near, unless
that rank's lease had run out (a starved host; the harness asks the daemon's
log, `Tally.note_went_away`): a reconnect of the rank, or the engine's
workers leaving its other pool, must not end this pool's jobs. The job in
flight is published (`Tally.engine_job`) so that the twin can leave while
one runs. After a store of the timeout scheduler timed out, every other
step takes its keys (`Tally.suspect`), so that any hit on them is loaded
and checked.

The engine process starts its ranks and starts one again when it dies (the
fault injector SIGKILLs them); a rank whose engine died exits by itself.
Scheduler and Worker objects live as long as their process: the client
library reconnects them after a daemon restart; they are re-created only if
a call raises something the library does not promise.
"""

from __future__ import annotations

import os
import random
from typing import Any

from kvd_client import Scheduler
from kvd_client.errors import ErrorCode, KvdError, MissingKey, NotReady
from kvd_client.protocol import JobResult
from kvd_tools.harness import RankExited, RankProcess, RankSilent, close_ranks
from kvd_tools.soak.actors import SESSION_LOST, count_failure
from kvd_tools.soak.rank import worker_main
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.workload import (
    CAPACITY_BYTES,
    ENGINE_ID,
    ENGINE_KEYS,
    MAX_ENGINE_CHAIN,
    POOL,
    WORLD_SIZE,
    engine_key,
    key_number,
    layout,
    timeout_key,
)

READY_S = 120.0  # a rank imports torch and attaches; slow on a loaded host


class Rank:
    """The engine's handle on one worker process, kept across its restarts."""

    def __init__(self, rank: int, tally: Tally, slot: int, endpoint: str, wait_s: float) -> None:
        self.rank, self.tally, self.slot = rank, tally, slot
        self.endpoint, self.wait_s = endpoint, wait_s
        self.process: RankProcess | None = None
        self.starts = 0
        self.hung = False

    def start(self) -> None:
        args = (self.tally, self.slot, self.endpoint, os.getpid(), self.wait_s)
        self.process = RankProcess(self.rank, worker_main, args, name=f"rank{self.rank}")
        self.starts += 1
        self.tally.set_worker_pid(self.rank, self.process.pid)

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def receive(self, seq: int, timeout: float) -> tuple[Any, ...] | None:
        """The reply to step `seq` (older replies are skipped); None if the rank died or hung.

        `hung` tells the two apart: the pipe stayed open and silent for `timeout`.
        """
        assert self.process is not None
        self.hung = False
        try:
            while True:
                reply: tuple[Any, ...] = self.process.receive(timeout)
                if reply[1] == seq:
                    return reply
        except RankSilent:
            self.hung = True
        except RankExited:
            self.hung = False  # dead, not hung: the caller restarts it
        return None

    def stop(self, kill: bool) -> None:
        if self.process is not None:
            self.process.stop(kill=kill)
        self.process = None


# -- the engine's scheduler ------------------------------------------------------------


def engine_main(tally: Tally, slot: int, endpoint: str, seed: int, wait_s: float) -> None:
    """Process entry point of the engine: steps until the harness sets the stop flag."""
    tally.log_to_file("engine")
    engine = Engine(tally, slot, endpoint, seed, wait_s)
    try:
        while not tally.stopped:
            engine.step()
    finally:
        engine.close()


class Engine:
    def __init__(self, tally: Tally, slot: int, endpoint: str, seed: int, wait_s: float) -> None:
        self.tally, self.slot, self.endpoint = tally, slot, endpoint
        self.rng = random.Random(seed)
        self.wait_s = wait_s
        self.seq = 0
        self.call = ""
        self.results: dict[int, JobResult] = {}
        self.ranks = [Rank(r, tally, slot + 1 + r, endpoint, wait_s) for r in range(WORLD_SIZE)]
        self.sched = self._open()

    def _open(self) -> Scheduler:
        return Scheduler(
            POOL,
            layout(),
            engine_id=ENGINE_ID,
            endpoint=self.endpoint,
            capacity_bytes=CAPACITY_BYTES,
            timeout_ms=1000,
        )

    def close(self) -> None:
        self.seq += 1
        close_ranks([r.process for r in self.ranks if r.process is not None], ("close", self.seq))
        for r in self.ranks:
            r.process = None
        self.sched.close()

    def step(self) -> None:
        if not self._ranks_up():
            return
        self.call = "step"
        try:
            self._step()
        except Exception as exc:  # a client call raised: counted, see count_failure
            if count_failure(self.tally, self.slot, "engine", self.call, exc):
                self.sched.close()
                self.sched = self._open()

    def _step(self) -> None:
        s, add = self.sched, self.tally.add
        first = self.rng.randrange(ENGINE_KEYS)
        keys = [engine_key(first + i) for i in range(self.rng.randint(1, MAX_ENGINE_CHAIN))]
        suspect = self.tally.suspect()
        if suspect is not None and self.rng.random() < 0.5:
            keys = [timeout_key(suspect[0] + i) for i in range(suspect[1])]  # a timed-out store's
        else:
            suspect = None
        add(self.slot, "ops")
        self.call = "lookup"
        hits = s.lookup(keys)
        if hits is None:
            return  # a store of one of them is in flight: retry later
        job, started = None, self._session()
        if hits:
            add(self.slot, "ops")
            self.call = "load"
            try:
                job = s.load(keys[:hits], list(range(hits)))
            except (MissingKey, NotReady):
                add(self.slot, "races")
            except KvdError as exc:
                if exc.code != ErrorCode.WORKERS_MISSING and exc.code not in SESSION_LOST:
                    self._violation(f"load raised {exc}")
            if job is None:
                hits = 0
        loads = [(i, key_number(k)) for i, k in enumerate(keys[:hits])]
        fills = [(hits + i, key_number(k)) for i, k in enumerate(keys[hits:])]
        oks = self._ask(("load", job, loads, fills))
        if oks is None:
            return
        if job is not None:
            self._check(job, oks, "load", started)
            if all(oks) and suspect is not None:
                add(self.slot, "suspect_blocks_loaded", hits)
            if all(oks):
                add(self.slot, "ops")
                self.call = "touch"
                s.touch(keys[:hits])
        if hits == len(keys):
            return
        add(self.slot, "ops")
        self.call = "store"
        started = self._session()
        try:
            ticket = s.store(keys[hits:], list(range(hits, len(keys))))
        except KvdError as exc:
            if exc.code != ErrorCode.WORKERS_MISSING:
                raise
            return
        if ticket is None and started is not None and not s.connected:
            # No reply in time (a daemon stall): the daemon may still take the store,
            # but this engine never names its job, and overwrites the blocks next step.
            add(self.slot, "engine_store_timeouts")
        if ticket is None or ticket.job_id is None:
            return
        oks = self._ask(("store", ticket.job_id))
        if oks is not None:
            self._check(ticket.job_id, oks, "store", started)
            if all(oks):
                add(self.slot, "stores")

    def _ask(self, msg: tuple[Any, ...]) -> list[bool] | None:
        """Sends one step to every rank; their ok flags, or None when a rank died (restarted)."""
        self.seq += 1
        self.tally.set_engine_job(msg[1] or 0)
        try:
            return self._ask_ranks(msg)
        finally:
            self.tally.set_engine_job(0)

    def _ask_ranks(self, msg: tuple[Any, ...]) -> list[bool] | None:
        sent = []
        for r in self.ranks:
            try:
                assert r.process is not None
                r.process.send((msg[0], self.seq, *msg[1:]))
                sent.append(r)
            except (OSError, ValueError):
                pass  # a killed rank's pipe: it is left out of `sent` and counted below
        replies = [r.receive(self.seq, self.wait_s + 30) for r in sent]
        if len(sent) < len(self.ranks) or any(reply is None for reply in replies):
            if msg[1] is not None:
                self.tally.add(self.slot, "failed_jobs")  # a rank died with the job in flight
            for r, reply in zip(sent, replies, strict=True):
                if reply is None and r.hung:  # a rank must answer within its wait
                    self._violation(f"rank {r.rank} did not answer a step within its wait")
                    r.stop(kill=True)
            return None
        return [bool(reply[2]) for reply in replies if reply is not None]

    def _check(self, job: int, oks: list[bool], kind: str, started: tuple[int, int] | None) -> None:
        self.tally.add(self.slot, "ops")
        self.call = "finished"
        for r in self.sched.finished():
            self.results[r.job_id] = r
        if not all(oks):
            self.tally.add(self.slot, "failed_jobs")
        if started is None or self._session() != started:
            # Another session (the daemon restarted: job ids start again) answers
            # for no job of the old one; its results are not this job's.
            self.results.clear()
            return
        result = self.results.pop(job, None)
        if not all(oks):
            if result is not None and result.ok:
                self._violation(f"daemon reported {kind} job {job} ok; rank oks {oks}")
        elif result is not None and not result.ok:
            self.tally.add(self.slot, "acked_but_failed")
            if "went away" in result.detail and not self.tally.excused():
                self.tally.note_went_away(job, f"{kind} job failed ({result.detail!r})")
        if len(self.results) > 1000:
            self.results.clear()

    def _session(self) -> tuple[int, int] | None:
        """The scheduler's session and pool generation now; None while disconnected."""
        s = self.sched
        if not s.connected or s.attached is None or s.session_id is None:
            return None
        return (s.session_id, s.attached.generation)

    def _ranks_up(self) -> bool:
        """Starts dead ranks again and waits until each has said ready."""
        for r in self.ranks:
            if r.alive():
                continue
            if r.starts:
                self.tally.add(self.slot, "worker_restarts")
            r.stop(kill=True)
            r.start()
            if self.tally.stopped or r.receive(-1, READY_S) is None:
                return False
        return True

    def _violation(self, detail: str) -> None:
        self.tally.violation(self.slot, f"engine: {detail}")
