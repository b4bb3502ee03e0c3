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

Backends over one region (the parts of slots holding several device blocks,
`SlotLayout.of`) share its registration: the first registers it, the last
to close unregisters it. It is registered in pieces of at most
`MAX_REGISTER_BYTES` (64 GiB), each a whole number of rows and of pages, as
vLLM registers its offload region (`MAX_HOST_REGISTER_CHUNK_BYTES = 64 *
1024**3` and `pin_mmap_region` in `vllm/v1/kv_offload/cpu/gpu_worker.py`,
"to avoid driver limits on large host allocations"); a piece refused undoes
the ones before it. No memcpy crosses a piece: a stretch of adjacent pool
blocks is cut where a piece ends, as it is where a staging chunk ends.

A registration the driver refuses (a sandbox such as gVisor that cannot pin
a shared mapping, a pool past what the driver will lock) raises KvdError:
the vLLM worker logs "kvd offloading off" at its start, and every job after
fails at once (a load recomputed, a store not completed; one log line a
kind at most every 30 s, `kvd_client.vllm.boundary`). A failed
`cudaHostRegister` leaves its error pending on the calling thread, and
torch's next launch check (`cudaGetLastError` after each kernel) would
report it as that kernel's failure: vLLM's next forward pass would crash
the engine. So the failure is cleared at once with `cudaGetLastError`, as
vLLM's own `host_register` does (`vllm/v1/kv_offload/cpu/host_register.py`).
torch's `torch.cuda.cudart()` has `cudaHostRegister` but no
`cudaGetLastError`, and the error must be cleared in the runtime that
recorded it, so registering, unregistering and clearing all go through the
CUDA runtime library torch loaded (found in `/proc/self/maps`, as vLLM's
`find_loaded_library` finds it), called with ctypes. A refusal is kept for
the process: later backends raise it again without asking the driver, so a
worker that maps the pool again for each job does not pin (and unpin) up to
the whole pool on every one.

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

import ctypes
import functools
import itertools
import math
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvd_client.backends.base import CopyJob, CopyResult, TransferBackend
from kvd_client.backends.views import BlockViews, KvCaches, id_tensor
from kvd_client.copy_plan import CopyPlan
from kvd_client.errors import BadRequest, ErrorCode, KvdError
from kvd_client.geometry import Geometry

if TYPE_CHECKING:
    from typing_extensions import Buffer

NUM_STREAMS = 2
STAGING_BYTES = 64 << 20
_HOST_REGISTER_DEFAULT = 0
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
MAX_REGISTER_BYTES = 64 << 30  # one cudaHostRegister call at most (module docstring)
# (host pointer, bytes) -> (backends of this process holding that registration,
# the addresses of its pieces)
_PINNED: dict[tuple[int, int], tuple[int, list[int]]] = {}
_PINNED_LOCK = threading.Lock()  # a worker's keeper thread builds backends too
_REFUSED: list[str] = []  # why the driver refused a registration in this process


def _loaded_library(prefix: str) -> str | None:
    """The path of the loaded library `prefix`.so[...] (or `prefix`-<hash>.so), if any."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line[line.find("/") :].strip() if "/" in line else ""
            if path.rsplit("/", 1)[-1].startswith((f"{prefix}.", f"{prefix}-")):
                return path
    return None


@functools.cache
def _cudart() -> Any:
    """The CUDA runtime torch loaded, with the three calls kvd makes (module docstring)."""
    path = _loaded_library("libcudart")
    if path is None:
        raise KvdError("no CUDA runtime (libcudart) is loaded here: cannot pin the pool",
                       ErrorCode.INTERNAL)  # fmt: skip
    lib = ctypes.CDLL(path)
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cudaGetLastError.argtypes = []
    for call in (lib.cudaHostRegister, lib.cudaHostUnregister, lib.cudaGetLastError):
        call.restype = ctypes.c_int
    return lib


def _piece_bytes(row_bytes: int) -> int:
    """Bytes of a registration piece: whole rows and whole pages (so no page is
    in two pieces), at most `MAX_REGISTER_BYTES` unless one such unit is more."""
    unit = math.lcm(row_bytes, mmap.PAGESIZE)
    return max(1, MAX_REGISTER_BYTES // unit) * unit


def _register(ptr: int, nbytes: int, row_bytes: int) -> list[int]:
    """Registers `nbytes` at `ptr` as pinned memory, piece by piece (`_piece_bytes`);
    the pieces' addresses. KvdError, with the CUDA error cleared and the pieces
    before it undone, if the driver refuses one (now or earlier in this process)."""
    if _REFUSED:
        raise KvdError(f"{_REFUSED[0]} (refused earlier in this process)", ErrorCode.INTERNAL)
    cudart = _cudart()
    piece = _piece_bytes(row_bytes)
    done: list[int] = []
    for offset in range(0, nbytes, piece):
        code = int(cudart.cudaHostRegister(ptr + offset, min(piece, nbytes - offset),
                                           _HOST_REGISTER_DEFAULT))  # fmt: skip
        if code == 0:
            done.append(ptr + offset)
            continue
        cudart.cudaGetLastError()  # else torch's next launch check fails the next kernel
        _unregister(done)
        hint = " (already registered: close the other backend first)" * (
            code == _ALREADY_REGISTERED
        )
        _REFUSED.append(f"cudaHostRegister of the pool failed at byte {offset} of {nbytes}: "
                        f"cudaError {code}{hint}")  # fmt: skip
        raise KvdError(_REFUSED[0], ErrorCode.INTERNAL)
    return done


def _unregister(pieces: list[int]) -> None:
    """Unregisters the pieces `_register` pinned, last first; a failure is cleared,
    not raised (close goes on)."""
    cudart = _cudart()
    for address in reversed(pieces):
        if int(cudart.cudaHostUnregister(address)) != 0:
            cudart.cudaGetLastError()


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
        with torch.cuda.device(device), _PINNED_LOCK:
            holders, pieces = _PINNED.get(self._pin, (0, []))
            if not holders:
                pieces = _register(*self._pin, geometry.row_bytes)
            _PINNED[self._pin] = (holders + 1, pieces)
            self._registered = True
        # Pool blocks a registration piece holds: no memcpy crosses a piece.
        self._piece_rows = _piece_bytes(geometry.row_bytes) // geometry.row_bytes
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
        with _PINNED_LOCK:
            holders, pieces = _PINNED.pop(self._pin)
            if holders > 1:
                _PINNED[self._pin] = (holders - 1, pieces)
            else:
                _unregister(pieces)

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
