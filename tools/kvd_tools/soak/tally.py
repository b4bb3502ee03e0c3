"""Runs in the soak harness and its client processes: counters and findings that survive SIGKILL.

A process killed at any instant must not lose what it counted, and must not
leave a lock held (a `multiprocessing.Queue` or `Event` killed mid-operation
can block every other process). So the tally is lock-free shared memory:

    counts   int64 [num_slots][num_fields]  slot s is written only by the
                                            process that plays slot s now
    control  int64 [stop, worker pid per rank, reconnect armed per rank,
                    stalled, excused until (ms), leave armed, engine job,
                    engine job last started (ms), suspect keys (first x 64 +
                    count), suspect until (ms)]

A control word has one writer at a time, or a writer that sets it and one
that clears it (the fault's arm and its firing): no lock is needed.

and findings (violations, with details) are lines appended to a file with
one `write` each (O_APPEND keeps them whole).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from multiprocessing.context import SpawnContext
from pathlib import Path

FIELDS = (
    "ops",  # requests a client made to the daemon
    "violations",  # data or protocol contract broken (must stay 0)
    "loads",  # load jobs that completed on a rank
    "stores",  # store jobs that completed on every rank
    "blocks_verified",  # loaded blocks whose bytes were checked
    "races",  # a lookup hit evicted (or re-stored) before its load: a miss
    "failed_jobs",  # jobs that failed (rank killed, daemon restarted, timeout)
    "session_lost",  # a call saw the daemon restart or the session expire
    "hot_path_raises",  # lookup/store/touch/finished raised instead of 0/None
    "worker_restarts",  # engine worker processes started again after dying
    "recreated",  # a Scheduler/Worker re-created because a call raised
    "worker_reconnects",  # a rank dropped and reopened its session during a store
    "reconnects_before_read",  # ... before it had read the job's push
    "store_timeouts",  # a store of the timeout scheduler got no reply in a daemon stall
    "late_store_answers",  # ... got its reply after all (the stall ended first)
    "engine_store_timeouts",  # a store of the TP engine itself got no reply in time
    "suspect_blocks_loaded",  # blocks of a timed-out store's keys the engine loaded later
    "second_pool_leaves",  # the engine's workers on its second pool said goodbye
    "leaves_during_job",  # ... while a job of the first pool was in flight
    "acked_but_failed",  # every rank acknowledged a job ok, the daemon failed it
    "late_refusals",  # jobs a rank refused unstarted: unnamed past their deadline, abandoned
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}
STOP = 0
WORKER_PIDS = 1


class Tally:
    """Shared counters, the stop flag and the findings file of one soak run."""

    def __init__(self, ctx: SpawnContext, num_slots: int, run_dir: Path, world_size: int) -> None:
        self.num_slots = num_slots
        self.counts = ctx.RawArray(ctypes.c_int64, num_slots * len(FIELDS))
        self.control = ctx.RawArray(ctypes.c_int64, WORKER_PIDS + 2 * world_size + 7)
        self._reconnect = WORKER_PIDS + world_size
        self._stalled = self._reconnect + world_size
        (
            self._excused,
            self._leave,
            self._engine_job,
            self._engine_active,
            self._suspect,
            self._suspect_until,
        ) = range(self._stalled + 1, self._stalled + 7)
        self.run_dir = str(run_dir)

    # -- written by one process per slot ---------------------------------------

    def add(self, slot: int, field: str, n: int = 1) -> None:
        self.counts[slot * len(FIELDS) + _INDEX[field]] += n

    def violation(self, slot: int, detail: str) -> None:
        """Counts one violation and appends its detail to the findings file."""
        self.add(slot, "violations")
        _append(
            self.findings_path,
            f"{time.strftime('%H:%M:%S')} pid={os.getpid()} slot={slot} {detail}",
        )

    def note_went_away(self, job: int, detail: str) -> None:
        """A job every rank acked that the daemon failed for a rank that "went away",
        with no stall or restart near; the harness asks the daemon's log why."""
        _append(os.path.join(self.run_dir, "went_away.log"), f"{job} {detail}")

    def went_away(self) -> list[tuple[int, str]]:
        try:
            lines = Path(self.run_dir, "went_away.log").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        return [(int(job), detail) for job, _, detail in (line.partition(" ") for line in lines)]

    # -- read by the harness ---------------------------------------------------

    def get(self, slot: int, field: str) -> int:
        return int(self.counts[slot * len(FIELDS) + _INDEX[field]])

    def total(self, field: str) -> int:
        return sum(self.get(slot, field) for slot in range(self.num_slots))

    def totals(self) -> dict[str, int]:
        return {name: self.total(name) for name in FIELDS}

    def findings(self, limit: int = 20) -> list[str]:
        try:
            lines = Path(self.findings_path).read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        return lines[:limit]

    @property
    def findings_path(self) -> str:
        return os.path.join(self.run_dir, "violations.log")

    # -- control words ---------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return bool(self.control[STOP])

    def stop(self) -> None:
        self.control[STOP] = 1

    def worker_pid(self, rank: int) -> int:
        return int(self.control[WORKER_PIDS + rank])

    def set_worker_pid(self, rank: int, pid: int) -> None:
        self.control[WORKER_PIDS + rank] = pid

    # -- faults that the clients fire (armed by the harness) -------------------

    def arm_reconnect(self, rank: int) -> bool:
        """Asks rank `rank` to reconnect during its next store; False if already asked."""
        if self.control[self._reconnect + rank]:
            return False
        self.control[self._reconnect + rank] = 1
        return True

    def take_reconnect(self, rank: int) -> bool:
        """In the rank: whether a reconnect is asked for (and no longer, once taken)."""
        if not self.control[self._reconnect + rank]:
            return False
        self.control[self._reconnect + rank] = 0
        return True

    def arm_leave(self) -> bool:
        """Asks the twin's workers to leave during a job of the engine; False if already asked."""
        if self.control[self._leave]:
            return False
        self.control[self._leave] = 1
        return True

    @property
    def leave_armed(self) -> bool:
        """Whether the twin's workers are to leave (until they did: `clear_leave`)."""
        return bool(self.control[self._leave])

    def clear_leave(self) -> None:
        self.control[self._leave] = 0

    @property
    def stalled(self) -> bool:
        """Whether the daemon is stopped (SIGSTOP) right now."""
        return bool(self.control[self._stalled])

    def set_stalled(self, stalled: bool) -> None:
        self.control[self._stalled] = int(stalled)

    def excuse_until(self, until: float) -> None:
        """Jobs that fail while every rank acked are a fault's doing until `until`
        (`time.monotonic()`, one clock for every process on the host)."""
        self.control[self._excused] = int(until * 1000)

    def excused(self) -> bool:
        return time.monotonic() * 1000 <= self.control[self._excused]

    def set_suspect(self, first: int, count: int, until: float) -> None:
        """Keys `first` .. `first + count - 1` of a store that timed out: the engine
        loads and checks them often until `until` (`time.monotonic()`)."""
        self.control[self._suspect_until] = 0  # never a half-written pair
        self.control[self._suspect] = first * 64 + count
        self.control[self._suspect_until] = int(until * 1000)

    def suspect(self) -> tuple[int, int] | None:
        """(first key, count) of the last timed-out store while it is suspect, else None."""
        if time.monotonic() * 1000 > self.control[self._suspect_until]:
            return None
        first, count = divmod(int(self.control[self._suspect]), 64)
        return first, count

    @property
    def engine_job(self) -> int:
        """The job the engine's ranks are running now; 0 when none."""
        return int(self.control[self._engine_job])

    def set_engine_job(self, job: int) -> None:
        self.control[self._engine_job] = job
        if job:
            self.control[self._engine_active] = int(time.monotonic() * 1000)

    def engine_active(self, within_s: float) -> bool:
        """Whether the engine's ranks started a job within the last `within_s` seconds."""
        return time.monotonic() * 1000 - self.control[self._engine_active] <= within_s * 1000

    def log_to_file(self, name: str) -> None:
        """Sends this process's log records (the client library's warnings) to the run dir."""
        logging.basicConfig(
            filename=os.path.join(self.run_dir, "clients.log"),
            level=logging.WARNING,
            format=f"%(asctime)s {name} pid=%(process)d %(levelname)s %(name)s: %(message)s",
            force=True,
        )


def _append(path: str, line: str) -> None:
    """One `write` of a whole line (O_APPEND keeps lines of many processes whole)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line[:1999] + "\n").encode(errors="replace"))
    finally:
        os.close(fd)
