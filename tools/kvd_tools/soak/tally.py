"""Runs in the soak harness and its client processes: counters and findings that survive SIGKILL.

A process killed at any instant must not lose what it counted, and must not
leave a lock held (a `multiprocessing.Queue` or `Event` killed mid-operation
can block every other process). So the tally is lock-free shared memory:

    counts   int64 [num_slots][num_fields]  slot s is written only by the
                                            process that plays slot s now
    control  int64 [stop, worker pid 0, worker pid 1, ...]

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
)
_INDEX = {name: i for i, name in enumerate(FIELDS)}
STOP = 0
WORKER_PIDS = 1


class Tally:
    """Shared counters, the stop flag and the findings file of one soak run."""

    def __init__(self, ctx: SpawnContext, num_slots: int, run_dir: Path, world_size: int) -> None:
        self.num_slots = num_slots
        self.counts = ctx.RawArray(ctypes.c_int64, num_slots * len(FIELDS))
        self.control = ctx.RawArray(ctypes.c_int64, WORKER_PIDS + world_size)
        self.run_dir = str(run_dir)

    # -- written by one process per slot ---------------------------------------

    def add(self, slot: int, field: str, n: int = 1) -> None:
        self.counts[slot * len(FIELDS) + _INDEX[field]] += n

    def violation(self, slot: int, detail: str) -> None:
        """Counts one violation and appends its detail to the findings file."""
        self.add(slot, "violations")
        line = f"{time.strftime('%H:%M:%S')} pid={os.getpid()} slot={slot} {detail}\n"
        fd = os.open(self.findings_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line[:2000].encode(errors="replace"))
        finally:
            os.close(fd)

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

    def log_to_file(self, name: str) -> None:
        """Sends this process's log records (the client library's warnings) to the run dir."""
        logging.basicConfig(
            filename=os.path.join(self.run_dir, "clients.log"),
            level=logging.WARNING,
            format=f"%(asctime)s {name} pid=%(process)d %(levelname)s %(name)s: %(message)s",
            force=True,
        )
