"""Runs in a TP worker process: maps the pool, receives transfer jobs, copies, acknowledges.

    engine worker (rank r)                      kvd daemon
      Worker(...)  -- Hello(worker), Attach -->  registers rank r of engine_id
                   <-- TransferJob(job, ...) --  one per rank per Store/Load
      backend copies device <-> slots of rank r
                   -- JobDone(job, r, ok) ---->  completes the job when all ranks acked

A worker runs only the jobs its engine names (SPEC section 5): the engine
passes the job ids of a step to its workers over its own per-step channel,
and `start(job_ids)` or `wait(job_ids)` names them. A store is named only
once the forward pass that wrote its blocks is done, so a job the daemon
pushed for a `Scheduler.store` whose reply never came (a timeout) is never
run. `poll()` receives jobs, launches the named ones that arrived, and
acknowledges the ones that finished. A job past its deadline (`TransferJob.
deadline`, the daemon's monotonic clock, which every process on a host
shares) is never started: it is acknowledged as failed without a copy, so
the daemon can settle it at once.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import posix_ipc

from kvd_client import protocol as p
from kvd_client.backends import CopyJob, CopyResult, TransferBackend, make_backend
from kvd_client.connection import Connection
from kvd_client.errors import BadRequest, KvdError, Unavailable
from kvd_client.geometry import Geometry
from kvd_client.settings import ClientSettings

log = logging.getLogger("kvd_client")
_REMEMBER_DONE = 65_536


class Mapping:
    """One mapped pool segment, owned by the worker (unmapped on close)."""

    def __init__(self, attached: p.Attached, replicated: bool) -> None:
        self.attached = attached
        self.geometry = Geometry(
            attached.num_blocks,
            attached.row_bytes,
            attached.slot_bytes,
            attached.num_slots,
            attached.slot_stride,
            replicated,
        )
        shm = posix_ipc.SharedMemory(attached.shm_name)
        try:
            size = self.geometry.size_bytes
            if shm.size < attached.data_offset + size:
                raise BadRequest(
                    f"segment {attached.shm_name} is {shm.size} bytes, expected "
                    f"{attached.data_offset + size}"
                )
            # Only the rows (SPEC 13): every SPEC 3 offset holds within the mapping.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(
                shm.fd,
                size,
                flags,
                mmap.PROT_READ | mmap.PROT_WRITE,
                offset=attached.data_offset,
            )
        finally:
            shm.close_fd()

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A tensor view still exports the buffer; the mapping goes with it.
            log.warning("pool mapping still referenced; it is released with its views")


class Worker:
    def __init__(
        self,
        rank: int,
        world_size: int,
        kv_caches: Any,
        *,
        pool: str,
        layout: p.Layout,
        engine_id: str,
        endpoint: str | None = None,
        device: str | None = None,
        timeout_ms: int = 2000,
        settings: ClientSettings | None = None,
    ) -> None:
        if not 0 <= rank < world_size or world_size != layout.world_size:
            raise BadRequest(
                f"rank {rank} of world_size {world_size} does not fit layout "
                f"world_size {layout.world_size}"
            )
        self.rank = rank
        self.pool = pool
        self.layout = layout
        self.kv_caches = kv_caches
        self.device = device
        self.settings = settings if settings is not None else ClientSettings.from_env()
        self._mapping: Mapping | None = None
        self._backend: TransferBackend | None = None
        self._submitted: set[int] = set()
        self._named: OrderedDict[int, None] = OrderedDict()  # named, not yet arrived
        self._arrived: dict[int, p.TransferJob] = {}  # arrived, not yet named
        self._abandoned: OrderedDict[int, None] = OrderedDict()  # waited for in vain: never run
        self._acked: OrderedDict[int, CopyResult] = OrderedDict()  # every answer given
        self._unsent: list[CopyResult] = []  # answers the daemon did not get (reconnect)
        self._done: OrderedDict[int, CopyResult] = OrderedDict()
        self.bytes_copied = 0
        self._conn = Connection(
            endpoint or self.settings.endpoint,
            role="worker",
            engine_id=engine_id,
            rank=rank,
            world_size=world_size,
            timeout_ms=timeout_ms,
            on_connect=self._attach,
        )
        self._conn.start()

    @property
    def connected(self) -> bool:
        return self._conn.connected

    @property
    def geometry(self) -> Geometry | None:
        return self._mapping.geometry if self._mapping else None

    def _attach(self, conn: Connection) -> None:
        reply = conn.call(p.Attach, self.pool, self.layout, None)
        assert isinstance(reply, p.Attached)
        current = self._mapping.attached if self._mapping else None
        if current is not None and (current.shm_name, current.generation) == (
            reply.shm_name,
            reply.generation,
        ):
            unsent, self._unsent = self._unsent, []
            self._send(conn, unsent)  # what the daemon missed while it was away
            return
        # First attach, or the daemon re-created the pool: map the new segment.
        # Job ids of the earlier segment mean nothing here any more.
        for state in (self._named, self._arrived, self._abandoned, self._acked, self._done):
            state.clear()
        self._unsent.clear()
        self._close_backend()
        self._mapping = Mapping(reply, self.layout.replicated)
        self._backend = make_backend(
            self.device,
            self.kv_caches,
            self._mapping.mm,
            self._mapping.geometry,
            self.rank,
            native_min_bytes=self.settings.native_min_bytes,
        )

    # -- jobs ------------------------------------------------------------------

    def start(self, job_ids: Iterable[int]) -> None:
        """Names jobs for this worker to run; each starts once it has arrived."""
        for job_id in job_ids:
            if job_id not in self._done and job_id not in self._submitted:
                self._named[job_id] = None
        while len(self._named) > _REMEMBER_DONE:  # ids that never came
            self._named.popitem(last=False)
        self._launch()

    def _remember(self, table: OrderedDict[int, Any], job_id: int, value: Any) -> None:
        table[job_id] = value
        if len(table) > _REMEMBER_DONE:
            table.popitem(last=False)

    def poll(self, timeout_ms: int = 0) -> list[int]:
        """Receives jobs, launches the named ones that arrived, acknowledges finished
        ones; returns the ids acknowledged."""
        self._conn.receive(timeout_ms)
        self._launch()
        return self._ack(self._backend.poll() if self._backend else [])

    def wait(self, job_ids: Iterable[int], timeout_s: float = 60.0) -> dict[int, bool]:
        """Blocks until every job in `job_ids` has arrived and finished; returns ok per job.

        A job that does not arrive within `timeout_s` (the daemon failed it, or
        the connection dropped) is reported as not ok, and is never run if it
        arrives later: the engine has moved on from its device blocks.
        """
        wanted = set(job_ids)
        self.start(wanted)
        deadline = time.monotonic() + timeout_s
        while True:
            self._launch()
            if self._backend is not None:
                running = [j for j in wanted if j in self._submitted]
                if running:
                    self._ack(self._backend.wait(running))
            missing = wanted - self._done.keys()
            if not missing:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                for job_id in missing - self._submitted:  # running ones will answer
                    self._named.pop(job_id, None)
                    self._remember(self._abandoned, job_id, None)
                break
            self._conn.receive(min(50, max(1, int(left * 1000))))
        return {j: (self._done.pop(j).ok if j in self._done else False) for j in wanted}

    def _launch(self) -> None:
        pushed = self._conn.pushed
        while pushed:
            job = pushed.popleft()
            if job.job_id in self._acked:  # pushed again after a reconnect: answered already
                self._send(self._conn, [self._acked[job.job_id]])
            elif job.job_id in self._abandoned:
                self._refuse(job, "the engine stopped waiting for it; not started")
            elif job.job_id not in self._submitted:
                self._arrived[job.job_id] = job
        now = time.monotonic()
        for job_id, job in list(self._arrived.items()):
            named = job_id in self._named
            late = job.deadline > 0 and now >= job.deadline
            if not (named or late):
                continue  # not this engine's to run yet
            del self._arrived[job_id]
            self._named.pop(job_id, None)
            if late:
                self._refuse(job, "past its deadline; not started")
            else:
                self._submit(job)

    def _refuse(self, job: p.TransferJob, why: str) -> None:
        self._finish([CopyResult(job.job_id, False, 0, 0.0, why)])

    def _submit(self, job: p.TransferJob) -> None:
        mapping = self._mapping
        if (
            self._backend is None
            or mapping is None
            or job.generation != mapping.attached.generation
        ):
            self._refuse(job, "job for another generation of the pool")
        else:
            self._submitted.add(job.job_id)
            self._backend.submit(
                CopyJob(job.job_id, job.kind, job.device_block_ids, job.pool_block_ids, job.writer)
            )

    def _ack(self, results: Sequence[CopyResult]) -> list[int]:
        self._finish(results)
        return [r.job_id for r in results]

    def _finish(self, results: Sequence[CopyResult]) -> None:
        for r in results:
            self._submitted.discard(r.job_id)
            self._remember(self._done, r.job_id, r)
            self._remember(self._acked, r.job_id, r)
            if r.ok:
                self.bytes_copied += r.nbytes
        self._send(self._conn, results)

    def _send(self, conn: Connection, results: Sequence[CopyResult]) -> None:
        """Acknowledges `results`; those the daemon could not get go again on reconnect."""
        for i, r in enumerate(results):
            try:
                conn.call(p.JobDone, r.job_id, self.rank, r.ok, r.nbytes, r.seconds, r.error or "")
            except Unavailable:
                log.warning("could not acknowledge job %d: daemon unreachable", r.job_id)
                self._unsent.extend(results[i:])
                del self._unsent[: max(0, len(self._unsent) - _REMEMBER_DONE)]
                return
            except KvdError as exc:
                log.warning("job %d acknowledgement refused: %s", r.job_id, exc)

    # -- lifecycle -------------------------------------------------------------

    def _close_backend(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def close(self) -> None:
        # Copies end first, and what finished is answered: the Goodbye tells the
        # daemon that this rank no longer writes, so it settles what it still owed.
        if self._backend is not None:
            self._ack(self._backend.poll())
        self._close_backend()
        self._conn.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
