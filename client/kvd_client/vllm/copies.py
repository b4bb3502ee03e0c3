"""Runs in a vLLM TP worker: the plug-in's copies, through kvd's transfer backends, asynchronously.

`KvdOffloadingWorker` (`worker`) hands each vLLM job here as device block
ids, KV cache group sizes and first block indices, and kvd slot ids. Nothing
here imports vLLM, so `tests/gpu/` drives this very code on a GPU host where
vLLM is not installed.

Each mapped segment (a generation of the pool) gets the backends kvd's own
`Worker` uses (`kvd_client.backends.make_backend`): on CUDA the region
registered as pinned memory, copies on side streams, an event per job; on
the CPU the torch and native copiers. A slot holds one offload chunk
(`blocks_per_chunk` device blocks), block after block, each block's pages of
every canonical tensor back to back; one backend per block of the chunk
(`SlotLayout.of(part=...)`):

    slot of rank r:  | block 0: t0 t1 ... tN | block 1: t0 t1 ... tN | ...
                       backend part 0          backend part 1

A block of any KV cache group moves with every tensor's page: vLLM's groups
share one block pool (`KVCacheCoordinator.block_pool`), so a device block
belongs to one group at a time, and a tensor its group does not use holds
nothing anyone reads at that block. Group by group, device block i of a
group is block `(skip + i) % blocks_per_chunk` of the group's chunk
`(skip + i) // blocks_per_chunk`, `skip = block_indices[g] %
blocks_per_chunk`, as vLLM's CPU worker reads it.

How a job runs (`mode`):

- "device" (CUDA): `submit` queues the copies on the backends' streams and
  returns; `poll` reports jobs whose events completed, `wait` synchronizes
  on the named jobs' events only.
- "thread" (CPU): `submit` queues the job for a thread of its own (torch and
  the native copier release the GIL), expedited jobs first; `wait` blocks
  until the named jobs are done.
- "sync" (CPU): the copy runs inside `submit`.

A job keeps its segment mapped (and its backends open) until it is done,
even when newer generations push the segment out of the last
`KEEP_SEGMENTS`.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import posix_ipc
import torch

from kvd_client import protocol as p
from kvd_client.backends import CopyJob, CopyResult, TransferBackend, make_backend
from kvd_client.errors import KvdError
from kvd_client.segment import read_segment_header
from kvd_client.worker import Mapping

KEEP_SEGMENTS = 3  # segments (generations of the pool) kept mapped
CPU_MODES = ("thread", "sync")
DEFAULT_CPU_MODE = "sync"  # measured no slower on 2 cores: docs/benchmarks.md, kvd bench vllm


@dataclass(slots=True)
class Done:
    """How a job ended: `nbytes` copied in `seconds` of copying; `error` says why not ok,
    `refused` if no copy started (past its deadline, cancelled)."""

    job_id: int
    ok: bool
    nbytes: int
    seconds: float
    error: str | None = None
    refused: bool = False


class Segment:
    """One mapped generation of the pool and its backends (one per block of a chunk)."""

    def __init__(self, mapping: Mapping, backends: list[TransferBackend]) -> None:
        self.mapping = mapping
        self.backends = backends
        self.jobs = 0  # jobs submitted on it and not done
        self.retired = False  # pushed out: closed once its last job is done

    def close(self) -> None:
        for backend in self.backends:
            backend.close()  # waits for copies in flight, then lets go of the region
        self.backends = []
        self.mapping.close()


@dataclass(eq=False, slots=True)
class _Job:
    job_id: int
    segment: Segment
    subs: list[tuple[int, CopyJob]]  # (part, the backend's job)
    check: Callable[[], str | None] | None
    pending: set[int] = field(default_factory=set)
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    refused: bool = False
    done: bool = False


class Copies:
    def __init__(
        self,
        device: Sequence[torch.Tensor],
        *,
        rank: int,
        replicated: bool,
        blocks_per_chunk: int = 1,
        num_groups: int = 1,
        mode: str = DEFAULT_CPU_MODE,
        keep_segments: int = KEEP_SEGMENTS,
    ) -> None:
        """`device`: vLLM's canonical tensors as `(num_blocks, page_bytes)` views; `mode`
        on the CPU "thread" or "sync" (CUDA tensors always run "device")."""
        self._device = list(device)
        if self._device[0].device.type == "cuda":
            self.mode = "device"
        elif mode in CPU_MODES:
            self.mode = mode
        else:
            raise ValueError(f"copies {mode!r}: one of {', '.join(CPU_MODES)}")
        self._rank = rank
        self._replicated = replicated
        self._chunk = blocks_per_chunk
        self._groups = num_groups
        self.block_bytes = sum(d.shape[1] for d in self._device)  # a device block, all tensors
        self._keep = keep_segments
        self._segments: OrderedDict[int, Segment] = OrderedDict()  # generation -> newest last
        self._open: list[Segment] = []  # every segment not closed, retired ones too
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()  # "thread": jobs not started
        self._jobs: dict[int, _Job] = {}  # submitted, not reported by `poll`
        self._finished: list[_Job] = []  # done, not reported
        self._subs: dict[int, _Job] = {}  # backend job id -> its job
        self._sub_ids = itertools.count(1)
        self._closing = False
        self._thread: threading.Thread | None = None
        if self.mode == "thread":
            self._thread = threading.Thread(target=self._serve, name="kvd-copies", daemon=True)
            self._thread.start()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """vLLM's canonical tensors, as `(num_blocks, page_bytes)` views."""
        return self._device

    # -- segments --------------------------------------------------------------

    def map(self, attached: p.Attached) -> None:
        """Maps `attached`'s segment and builds its backends; raises what stops it."""
        if attached.generation in self._segments:
            return
        mapping = Mapping(attached, self._replicated)
        backends: list[TransferBackend] = []
        try:
            for part in range(self._chunk):
                backends.append(make_backend(None, self._device, mapping.mm, mapping.geometry,
                                             self._rank, part=part, parts=self._chunk,
                                             loads_wait=True))  # fmt: skip
        except BaseException:
            Segment(mapping, backends).close()
            raise
        segment = Segment(mapping, backends)
        idle = []
        with self._cond:  # the connection's keeper thread may map too
            if attached.generation in self._segments:  # it did, meanwhile: keep its one
                idle.append(segment)
                self._open.append(segment)
            else:
                self._segments[attached.generation] = segment
                self._open.append(segment)
            while len(self._segments) > self._keep:
                _, old = self._segments.popitem(last=False)
                old.retired = True
                if old.jobs == 0:
                    idle.append(old)
        for old in idle:
            self._close(old)

    def map_by_name(self, pool: str, generation: int) -> None:
        """Maps the pool's segment of `generation` by its name, without the daemon."""
        name = f"/kvd.{pool}.{generation}"
        shm = posix_ipc.SharedMemory(name)
        try:
            h = read_segment_header(shm.fd)
        finally:
            shm.close_fd()
        self.map(p.Attached(0, name, generation, h.num_blocks, h.row_bytes, h.slot_bytes,
                            h.num_slots, h.slot_stride, "", h.data_offset))  # fmt: skip

    def has(self, generation: int) -> bool:
        return generation in self._segments

    def _close(self, segment: Segment) -> None:
        with self._cond:
            if segment not in self._open:
                return
            self._open.remove(segment)
        segment.close()

    # -- jobs ------------------------------------------------------------------

    def plan(
        self,
        device_ids: Sequence[int],
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        slot_ids: Sequence[int],
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per block of a chunk (part): its device blocks and their slots (module
        docstring); ValueError for a spec whose blocks and slots do not match.
        The ids may be numpy arrays (vLLM's), lists or tensors."""
        c = self._chunk
        if len(group_sizes) != self._groups or len(block_indices) != self._groups:
            raise ValueError(f"{len(group_sizes)} KV cache groups, not {self._groups}")
        device_all = torch.as_tensor(device_ids, dtype=torch.int64)
        slot_all = torch.as_tensor(slot_ids, dtype=torch.int64)
        devs, slots, parts = [], [], []
        b = s = 0
        for size, start in zip(group_sizes, block_indices, strict=True):
            if size == 0:
                continue
            at = torch.arange(size, dtype=torch.int64) + start % c
            count = int(at[-1]) // c + 1
            if b + size > len(device_all) or s + count > len(slot_all):
                break
            devs.append(device_all[b : b + size])
            slots.append(slot_all[s : s + count][at // c])
            parts.append(at % c)
            b, s = b + size, s + count
        if b != len(device_all) or s != len(slot_all):
            raise ValueError(
                f"{len(device_all)} device blocks and {len(slot_all)} slots do not match "
                f"(groups {list(group_sizes)}, {c} blocks a chunk)"
            )
        if not devs:
            return []
        dev, slot, part = torch.cat(devs), torch.cat(slots), torch.cat(parts)
        return [(j, dev[part == j], slot[part == j]) for j in range(c) if bool((part == j).any())]

    def submit(
        self,
        job_id: int,
        store: bool,
        generation: int,
        plan: list[tuple[int, torch.Tensor, torch.Tensor]],
        *,
        check: Callable[[], str | None] | None = None,
        expedited: bool = False,
    ) -> None:
        """Starts a job (`plan` from `plan`) on the mapped segment of `generation`;
        `check` says why it may not start (None: it may): right before the copy on
        the CPU, when it is queued on its stream on CUDA (which may run it later).
        Raises KvdError, before anything started, if the segment is not mapped."""
        kind = "store" if store else "load"
        subs = [(part, CopyJob(next(self._sub_ids), kind, dev.tolist(), slot.tolist()))
                for part, dev, slot in plan]  # fmt: skip
        with self._cond:  # found and counted at once: `map` retires only idle segments
            segment = self._segments.get(generation)
            if segment is None:
                raise KvdError(f"the pool's segment of generation {generation} is not mapped")
            job = _Job(job_id, segment, subs, check)
            segment.jobs += 1
            self._jobs[job_id] = job
            if self.mode == "thread":
                if expedited:  # vLLM waits for it at once: before every queued job
                    self._queue.appendleft(job)
                else:
                    self._queue.append(job)
                self._cond.notify_all()
        if self.mode == "sync":
            self._run(job)
        elif self.mode == "device":
            self._launch(job)

    def poll(self) -> list[Done]:
        """Jobs done since the last call; never blocks."""
        if self.mode == "device":
            for segment in list(self._open):
                for backend in segment.backends:
                    for result in backend.poll():
                        self._settle(result)
        with self._cond:
            finished, self._finished = self._finished, []
            for job in finished:
                self._jobs.pop(job.job_id, None)
        return [Done(j.job_id, j.error is None, j.nbytes if j.error is None else 0, j.seconds,
                     j.error, j.refused) for j in finished]  # fmt: skip

    def wait(self, job_ids: Iterable[int]) -> None:
        """Blocks until none of `job_ids` is running (`poll` then reports them);
        other jobs go on. Ids not submitted, or reported already, are skipped."""
        wanted = set(job_ids)
        if self.mode == "device":
            for job_id in wanted:
                job = self._jobs.get(job_id)
                if job is None:
                    continue
                for part, sub in job.subs:
                    if sub.job_id in job.pending:
                        for result in job.segment.backends[part].wait([sub.job_id]):
                            self._settle(result)
            return
        with self._cond:
            while any(j in self._jobs and not self._jobs[j].done for j in wanted):
                self._cond.wait()

    def close(self) -> None:
        """Lets the thread finish the jobs queued, then unmaps every segment."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        for segment in list(self._open):
            self._close(segment)
        self._segments.clear()

    # -- internals -------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
            self._run(job)

    def _run(self, job: _Job) -> None:
        """Copies `job` on this thread (CPU backends copy inside `submit`)."""
        try:
            self._launch(job)
            for part, sub in job.subs:
                if sub.job_id in job.pending:
                    for result in job.segment.backends[part].wait([sub.job_id]):
                        self._settle(result)
        except Exception as exc:  # reported as the job's failure, never raised
            job.error = job.error or f"{type(exc).__name__}: {exc}"
            for sub_id in job.pending:
                self._subs.pop(sub_id, None)
            job.pending.clear()
            self._finish(job)

    def _launch(self, job: _Job) -> None:
        try:
            why = job.check() if job.check is not None else None
        except Exception as exc:
            why = f"the deadline check failed: {exc}"
        if why is not None:
            job.error, job.refused = why, True
            self._finish(job)
            return
        for part, sub in job.subs:
            try:
                job.segment.backends[part].submit(sub)
            except Exception as exc:  # BadRequest: a closed backend; nothing queued
                job.error = job.error or f"{type(exc).__name__}: {exc}"
                continue
            job.pending.add(sub.job_id)
            self._subs[sub.job_id] = job
        if not job.pending:
            self._finish(job)

    def _settle(self, result: CopyResult) -> None:
        job = self._subs.pop(result.job_id, None)
        if job is None:
            return
        job.pending.discard(result.job_id)
        if result.ok:
            job.nbytes += result.nbytes
        else:
            job.error = job.error or result.error or "the copy failed"
        job.seconds += result.seconds
        if not job.pending:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        with self._cond:
            if job.done:
                return
            job.done = True
            self._finished.append(job)
            job.segment.jobs -= 1
            close = job.segment.retired and job.segment.jobs == 0
            self._cond.notify_all()
        if close:
            self._close(job.segment)
