"""Runs in a TP worker: the CUDA backend, asynchronous copies between GPU pages and the pool.

Built once: the mapped region is registered as pinned host memory
(`cudaHostRegister`, undone in `close`), so copies to and from it are true
asynchronous DMA; a few side streams, each with its own device staging buffer.

A job runs on one side stream, in chunks of up to `staging_rows` blocks
sorted by pool block:

    store: device pages --gather (one kernel per layer)--> staging, laid out
           as slots --> one D2H copy per stretch of consecutive pool blocks
    load:  one H2D copy per stretch --> staging --scatter (one kernel per
           layer)--> device pages

    staging (device):  [slot][slot][slot] ...   rows in pool-block order
                          |     |_____|
    region (host):     ...[p]...[q][q+1]...     a stretch of adjacent slots
                                               is one memcpy

So a job costs a few kernels plus one memcpy per stretch of adjacent slots
(per slot when the pool is sharded: a rank's slots are then `row_bytes`
apart, and torch has no strided async copy), however scattered its device
blocks are. A store first makes its stream wait for the current (compute)
stream, so it reads the pages only after the forward pass that wrote them; a
load does not wait, so its device blocks must not be in use by queued work.
A CUDA event per job tells `poll` and `wait` when it is done. With
`loads_wait=True` (the vLLM plug-in) a load waits for the current stream
too: work queued there earlier (vLLM zeroing a block it reallocated) must not
overwrite what the load brings.

The region is pinned for DMA by `host_pin` (shared by the backends over
it, in pieces; a refusal raises KvdError: the vLLM worker logs "kvd
offloading off" at its start, and every job after fails at once, a load
recomputed, a store not completed). No memcpy crosses a registration piece:
a stretch of adjacent pool blocks is cut where a piece ends, as it is where
a staging chunk ends.

Why raise rather than copy through pageable memory, as vLLM falls back to
(its copies "still work but may be slower"): whichever leaves less code that
has never run. torch's `non_blocking` copies to and from pageable memory
are synchronous with the host (a D2H copy returns when it is done, after
the store's wait for the compute stream), so every `submit` would block
vLLM's step, against this module's contract, in a mode that neither
`tests/gpu/` nor a user has run. Raising adds only the failure branch
itself (clear, roll back, raise), which `tests/unit/test_backend_cuda_pin.py`
runs against a stub runtime.

torch is imported at module level but nothing touches CUDA until a backend
is built, so this module imports on CPU-only hosts.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvd_client.backends import host_pin
from kvd_client.backends.base import CopyJob, CopyResult, TransferBackend
from kvd_client.backends.views import BlockViews, KvCaches, id_tensor
from kvd_client.copy_plan import CopyPlan
from kvd_client.errors import BadRequest, KvdError
from kvd_client.geometry import Geometry

if TYPE_CHECKING:
    from typing_extensions import Buffer

NUM_STREAMS = 2
STAGING_BYTES = 64 << 20


# torch.cuda's Python helpers carry no annotations; these wrappers type them.


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _event_done(event: torch.cuda.Event) -> bool:
    return bool(event.query())  # type: ignore[no-untyped-call]


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


@dataclass(slots=True)
class _InFlight:
    """A launched job; the tensors it reads or writes stay referenced until it is done."""

    job_id: int
    nbytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep: list[torch.Tensor] = field(default_factory=list)


class CudaBackend(TransferBackend):
    """Copies on side streams; `poll` checks events, `wait` synchronizes them."""

    def __init__(
        self,
        kv_caches: KvCaches,
        region: Buffer,
        geometry: Geometry,
        rank: int,
        *,
        num_streams: int = NUM_STREAMS,
        staging_bytes: int = STAGING_BYTES,
        part: int = 0,
        parts: int = 1,
        loads_wait: bool = False,
    ) -> None:
        views = BlockViews.build(kv_caches, region, geometry, rank, part=part, parts=parts)
        device = views.device[0].device
        if device.type != "cuda":
            raise BadRequest(f"the CUDA backend needs CUDA tensors, not {device}")
        self._device = device
        self._loads_wait = loads_wait
        self._pin = (views.host_flat.data_ptr(), geometry.size_bytes)
        self._registered = False
        with torch.cuda.device(device):
            host_pin.hold(*self._pin, geometry.row_bytes)
            self._registered = True
        # Pool blocks a registration piece holds: no memcpy crosses a piece.
        self._piece_rows = host_pin.piece_bytes(geometry.row_bytes) // geometry.row_bytes
        with torch.cuda.device(device):
            try:
                self._streams = [_new_stream(device) for _ in range(max(1, num_streams))]
                slot_elems = views.slots.shape[1]
                self._staging_rows = max(1, staging_bytes // views.layout.slot_bytes)
                self._staging = [
                    torch.empty(self._staging_rows, slot_elems, dtype=views.dtype, device=device)
                    for _ in self._streams
                ]
            except RuntimeError:
                self._unpin()
                raise
        self.views: BlockViews | None = views
        # Host slots are back to back (one slot per row, no padding): a stretch
        # of adjacent pool blocks is one contiguous host range.
        self._host_contiguous = views.layout.row_bytes == views.layout.slot_bytes
        self._next_stream = itertools.cycle(range(len(self._streams)))
        self._in_flight: OrderedDict[int, _InFlight] = OrderedDict()
        self._done: OrderedDict[int, CopyResult] = OrderedDict()

    # -- TransferBackend -------------------------------------------------------

    def submit(self, job: CopyJob) -> None:
        views = self.views
        if views is None:
            raise BadRequest("the backend is closed")
        if job.job_id in self._in_flight:
            raise BadRequest(f"job {job.job_id} is still in flight")
        start = time.perf_counter()
        try:
            plan = views.plan(job)
        except KvdError as exc:
            self._finish(CopyResult(job.job_id, False, 0, time.perf_counter() - start, str(exc)))
            return
        if plan.num_blocks == 0 or (plan.kind == "store" and not job.writer):
            self._finish(CopyResult(job.job_id, True, 0, time.perf_counter() - start))
            return
        index = next(self._next_stream)
        stream, staging = self._streams[index], self._staging[index]
        record = _InFlight(
            job.job_id,
            plan.num_blocks * views.layout.slot_bytes,
            _timing_event(),
            _timing_event(),
        )
        try:
            with torch.cuda.device(self._device):
                if plan.kind == "store" or self._loads_wait:
                    # Read the pages only after the forward pass that wrote them;
                    # a load: write them only after work queued on them.
                    stream.wait_stream(torch.cuda.current_stream(self._device))
                with torch.cuda.stream(stream):
                    record.start.record(stream)
                    self._launch(views, plan, staging, record.keep)
                    record.end.record(stream)
        except RuntimeError as exc:
            # Some copies may be queued; the job fails whole and the daemon
            # frees its slots (a failed load makes the engine recompute).
            stream.synchronize()
            self._finish(CopyResult(job.job_id, False, 0, time.perf_counter() - start, str(exc)))
            return
        self._in_flight[job.job_id] = record

    def poll(self) -> list[CopyResult]:
        for job_id, record in list(self._in_flight.items()):
            if self._query(record):
                self._complete(job_id)
        done = list(self._done.values())
        self._done.clear()
        return done

    def wait(self, job_ids: Iterable[int]) -> list[CopyResult]:
        wanted = list(dict.fromkeys(job_ids))
        for job_id in wanted:
            record = self._in_flight.get(job_id)
            if record is not None:
                try:
                    record.end.synchronize()
                except RuntimeError as exc:
                    self._complete(job_id, str(exc))
                    continue
                self._complete(job_id)
        return [self._done.pop(j) for j in wanted if j in self._done]

    def close(self) -> None:
        if self.views is None:
            return
        for stream in self._streams:
            stream.synchronize()
        self._in_flight.clear()
        self._done.clear()
        # Nothing may still copy to or from the region when it is unpinned.
        self._unpin()
        self._staging = []
        self.views = None

    # -- internals -------------------------------------------------------------

    def _unpin(self) -> None:
        """Gives up this backend's hold on the registration; the last one unregisters."""
        if not self._registered:
            return
        self._registered = False
        host_pin.release(*self._pin)

    def _finish(self, result: CopyResult) -> None:
        self._done[result.job_id] = result

    def _query(self, record: _InFlight) -> bool:
        try:
            return _event_done(record.end)
        except RuntimeError:
            return True  # _complete reports the error

    def _complete(self, job_id: int, error: str | None = None) -> None:
        record = self._in_flight.pop(job_id)
        seconds = 0.0
        if error is None:
            try:
                record.end.synchronize()
                seconds = record.start.elapsed_time(record.end) / 1000.0
            except RuntimeError as exc:
                error = str(exc)
        ok = error is None
        self._finish(CopyResult(job_id, ok, record.nbytes if ok else 0, seconds, error))

    def _launch(
        self, views: BlockViews, plan: CopyPlan, staging: torch.Tensor, keep: list[torch.Tensor]
    ) -> None:
        """Queues the job's copies on the current stream, chunk by chunk of the staging buffer."""
        store = plan.kind == "store"
        pool = id_tensor(plan.pool_ids)
        pool_sorted, order = torch.sort(pool)
        device_sorted = id_tensor(plan.device_ids)[order]
        # Index upload through pinned memory: a copy from pageable memory would
        # block this thread until the stream (waiting on compute) caught up.
        pinned = torch.empty(device_sorted.numel(), dtype=torch.int64, pin_memory=True)
        pinned.copy_(device_sorted)
        device_idx = pinned.to(self._device, non_blocking=True)
        keep += [pinned, device_idx]
        item = views.dtype.itemsize
        layer_cols = [
            staging.narrow(1, off // item, host.shape[1])
            for off, host in zip(views.layout.layer_offsets, views.host, strict=True)
        ]
        for chunk_start, pieces in _chunks(pool_sorted, self._staging_rows, self._piece_rows):
            k = min(self._staging_rows, pool_sorted.numel() - chunk_start)
            idx = device_idx[chunk_start : chunk_start + k]
            if store:
                for dev, col in zip(views.device, layer_cols, strict=True):
                    torch.index_select(dev, 0, idx, out=col[:k])
            for first, a, b in pieces:
                self._host_copy(views, first, staging[a - chunk_start : b - chunk_start], store)
            if not store:
                for dev, col in zip(views.device, layer_cols, strict=True):
                    dev.index_copy_(0, idx, col[:k])

    def _host_copy(self, views: BlockViews, first: int, rows: torch.Tensor, store: bool) -> None:
        """Staging `rows` <-> pool blocks `first..`; one async memcpy per contiguous host range."""
        count = rows.shape[0]
        ranges = (
            [(views.slots.narrow(0, first, count), rows)]
            if self._host_contiguous
            else [(views.slots[first + i], rows[i]) for i in range(count)]
        )
        for host, dev in ranges:
            if store:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)


def _chunks(
    pool_sorted: torch.Tensor, rows: int, piece_rows: int
) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """Sorted pool ids cut into staging chunks of `rows`, each with its stretches of
    adjacent pool blocks as (first pool block, start, end) positions in sorted order;
    a stretch is cut where a chunk ends and where a registration piece of
    `piece_rows` pool blocks ends."""
    n = pool_sorted.numel()
    cuts = torch.nonzero(pool_sorted[1:] - pool_sorted[:-1] != 1).flatten().add_(1).tolist()
    bounds = [0, *cuts, n]
    firsts = pool_sorted[bounds[:-1]].tolist()
    chunks: list[tuple[int, list[tuple[int, int, int]]]] = [
        (start, []) for start in range(0, n, rows)
    ]
    for first, start, stop in zip(firsts, bounds[:-1], bounds[1:], strict=True):
        pool, a = first, start
        while a < stop:
            end = min(stop, (a // rows + 1) * rows, a + piece_rows - pool % piece_rows)
            chunks[a // rows][1].append((pool, a, end))
            pool, a = pool + end - a, end
    return chunks
