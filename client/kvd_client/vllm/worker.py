"""Runs in a vLLM TP worker: vLLM's `OffloadingWorker`, copying between its KV tensors and kvd.

vLLM hands the worker its canonical KV caches: per tensor, a `(num_blocks,
page_bytes)` int8 view, and per KV cache group the tensors its layers are
in. The rank's slot of a kvd block holds one offload chunk's pages of every
tensor, tensor after tensor (one row covers every tensor, as in vLLM's own
CPU offloading; a block of group g fills the tensors of group g):

    slot of rank r = row b + slot(r) * slot_stride
    | tensor 0: page x blocks_per_chunk | tensor 1: ... | ... |

A spec's device blocks come group by group (`group_sizes`); a group's first
block is block `block_indices[g]` of its request, so with `blocks_per_chunk`
> 1 (vLLM's `block_size` extra key) it may start inside its first chunk:
device block i of the group is page `(skip + i) % blocks_per_chunk` of
the group's chunk `(skip + i) // blocks_per_chunk`, `skip = block_indices[g]
% blocks_per_chunk`, as vLLM's CPU worker reads it.

vLLM's own transfer channel names the copies (`submit_store` /
`submit_load`, with device block ids and kvd slot ids that the scheduler
side got from the daemon, and the generation of the segment they belong
to); the copies run at once (torch index copies on the CPU), and
`get_finished` reports them. The worker keeps the last few segments it
mapped: after a cold daemon restart a load pinned in the old segment still
reads it (nobody writes there any more), never the new one. The daemon completes a store when
vLLM's scheduler side says every rank has finished (`complete_store`).

No exception from kvd leaves `submit_*` (SPEC section 12), and vLLM, which
asserts that every transfer succeeded, is told each one did. A load the
worker cannot serve (its segment is gone, the manager could not pin it, the
copy failed, or it comes past its deadline) leaves its device blocks in
`load_errors` and its job in `failed_loads`, which `KvdOffloadingConnector`
hands to vLLM to recompute, block by block or per request (the
spec turns kvd off under vLLM's plain connector, which could not). A store
copies nothing past its deadline or once vLLM reset the cache since its
prepare (`StepNotes`, each step from the scheduler side), and one whose
copy fails is reported not copied (`take_copies`, by its token), so the
manager completes it as failed: its slots are freed and nobody reads them.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict

import numpy as np
import posix_ipc
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.errors import BadRequest, KvdError
from kvd_client.segment import read_segment_header
from kvd_client.vllm.boundary import FailureLog
from kvd_client.vllm.manager import UNSERVABLE, StepNotes
from kvd_client.worker import Mapping

log = logging.getLogger("kvd_client.vllm")
KEEP_SEGMENTS = 3  # segments (generations of the pool) a worker keeps mapped


class KvdOffloadingWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        *,
        endpoint: str,
        pool: str,
        layout: p.Layout,
        engine_id: str,
        rank: int,
        capacity_bytes: int | None = None,
        blocks_per_chunk: int = 1,
    ) -> None:
        self._device = [t.tensor.view(torch.int8).view(t.tensor.shape[0], -1)
                        for t in kv_caches.tensors]  # fmt: skip
        pages = [d.shape[1] for d in self._device]
        self._chunk = blocks_per_chunk  # device blocks in a kvd block
        if sum(pages) * blocks_per_chunk != layout.slot_bytes:
            # The scheduler side is on and would complete stores this worker
            # could not write, so this stops the engine at start, clearly.
            raise BadRequest(
                f"vLLM's pages ({sum(pages)} bytes a block, {blocks_per_chunk} blocks a "
                f"chunk) do not fill the pool's slot of {layout.slot_bytes} bytes"
            )
        self._offsets = [sum(pages[:i]) * blocks_per_chunk for i in range(len(pages))]
        # Per KV cache group, the tensors its layers are in (vLLM's group_data_refs).
        self._group_tensors = [sorted({ref.tensor_idx for ref in refs})
                               for refs in kv_caches.group_data_refs]  # fmt: skip
        self._rank = rank
        self._layout = layout
        self._pool = pool
        self._capacity = capacity_bytes  # a worker may attach first and create the pool
        # generation -> (mapping, per-tensor host views), newest last
        self._segments: OrderedDict[int, tuple[Mapping, list[torch.Tensor]]] = OrderedDict()
        self._results: list[TransferResult] = []
        self.load_errors: set[int] = set()  # device blocks of loads not served
        self.failed_loads: set[int] = set()  # their jobs
        self.reports_load_errors = False  # set by KvdOffloadingConnector
        self._notes: StepNotes | None = None  # this step's, from the scheduler side
        self._copies: dict[int, bool] = {}  # store token -> copied, not reported yet
        self._failures = FailureLog(log)
        self._conn = Connection(
            endpoint,
            role="worker",
            engine_id=engine_id,
            rank=rank,
            world_size=layout.world_size,
            timeout_ms=2000,
            on_connect=self._attach,
        )
        try:
            self._conn.start()
        except KvdError as exc:  # the scheduler side cannot attach either: no jobs come
            log.warning("kvd offloading off for worker rank %d: pool %r: %s", rank, pool, exc)

    def _attach(self, conn: Connection) -> None:
        reply = conn.call(p.Attach, self._pool, self._layout, self._capacity)
        assert isinstance(reply, p.Attached)
        if reply.generation not in self._segments:
            try:
                self._map(reply)
            except (posix_ipc.Error, OSError, ValueError) as exc:  # BadSegment too
                # A KvdError: the keeper and the start log it and go on.
                raise KvdError(
                    f"worker rank {self._rank} cannot map pool {self._pool!r}: {exc}"
                ) from exc

    def _map_by_name(self, generation: int) -> None:
        """Maps the pool's segment of `generation` by its name, without the daemon: the
        scheduler side may have attached to a new daemon before this rank's keeper."""
        name = f"/kvd.{self._pool}.{generation}"
        shm = posix_ipc.SharedMemory(name)
        try:
            h = read_segment_header(shm.fd)
        finally:
            shm.close_fd()
        self._map(p.Attached(0, name, generation, h.num_blocks, h.row_bytes, h.slot_bytes,
                             h.num_slots, h.slot_stride, "", h.data_offset))  # fmt: skip

    def _map(self, reply: p.Attached) -> None:
        mapping = Mapping(reply, self._layout.replicated)
        g = mapping.geometry
        flat = torch.frombuffer(mapping.mm, dtype=torch.int8)
        base = g.slot_offset(0, self._rank)
        host = [  # per tensor: (kvd block, device block in it, page bytes)
            flat.as_strided(
                (g.num_blocks, self._chunk, d.shape[1]), (g.row_bytes, d.shape[1], 1), base + off
            )
            for d, off in zip(self._device, self._offsets, strict=True)
        ]
        self._segments[reply.generation] = (mapping, host)
        while len(self._segments) > KEEP_SEGMENTS:
            _, (old, _views) = self._segments.popitem(last=False)
            del _views
            old.close()

    # -- OffloadingWorker -------------------------------------------------------

    def note(self, notes: StepNotes | None) -> None:
        """This step's notes from the scheduler side (`KvdOffloadingConnector`),
        before the step's copies start."""
        if notes is not None:
            self._notes = notes

    def _late(self, spec: LoadStoreSpec) -> str | None:
        """Why a copy of `spec` may not start now, or None."""
        notes = self._notes
        token = getattr(spec, "token", 0)
        if token and notes is not None and token < notes.cancel_below:
            return "cancelled: vLLM reset the cache after its prepare_store"
        deadline = getattr(spec, "deadline", math.inf)
        if notes is not None and notes.session == getattr(spec, "session", None):
            deadline = max(deadline, notes.alive_until)
        late = time.monotonic() - deadline
        if late > 0:
            return f"{late:.3f} s past its deadline (its slots may be other blocks' by now)"
        return None

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        start = time.perf_counter()
        nbytes, copied = 0, False
        try:  # the boundary: a store not copied, never an engine stopped
            why = self._late(dst_spec)
            if why is None:
                nbytes = self._copy(src_spec, dst_spec, store=True)
                copied = True
            else:
                self._failures.note("store copy", f"job {job_id}: {why}", "refused")
        except Exception as exc:
            self._failures.note("store copy", f"job {job_id}: {exc}", "store not completed")
            nbytes = 0
        token = getattr(dst_spec, "token", 0)
        if token:
            self._copies[token] = copied
        self._results.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """vLLM 0.33 passes `expedited=True` for a sync load (`sync_load_budget_bytes`):
        its request runs this very step, and vLLM calls `wait()` on it at once. The
        copy is done when this returns, expedited or not, so `wait()` has nothing to
        wait for; a sync load not served goes to `load_errors` like any other, and
        vLLM 0.33 recomputes it (one KV cache group: `invalid_block_ids` of a running
        request). An asynchronous worker must not queue it behind regular loads."""
        start = time.perf_counter()
        nbytes = 0
        try:  # the boundary: a load not served is recomputed, never an engine stopped
            if getattr(src_spec, "generation", UNSERVABLE) == UNSERVABLE:
                self._load_error(job_id, dst_spec)  # the manager could not pin it, and counted it
            elif (why := self._late(src_spec)) is not None:
                self._failures.note("load copy", f"job {job_id}: {why}", "recomputed")
                self._load_error(job_id, dst_spec)
            else:
                nbytes = self._copy(dst_spec, src_spec, store=False)
        except Exception as exc:
            self._failures.note("load copy", f"job {job_id}: {exc}", "recomputed")
            self._load_error(job_id, dst_spec)
            nbytes = 0
        self._results.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    def _copy(self, device: GPULoadStoreSpec, pool: LoadStoreSpec, *, store: bool) -> int:
        """Copies between device blocks and slots; raises what stops it (the
        caller reports it). Returns the bytes copied."""
        assert isinstance(pool, CPULoadStoreSpec)
        if len(device.block_ids) == 0:  # nothing to copy, no segment to map
            return 0
        host_views = self._segment(getattr(pool, "generation", UNSERVABLE))[1]
        nbytes = 0
        for tensors, ids, slot_ids, pages in self._plan(device, pool):
            for t in tensors:
                dev, host = self._device[t], host_views[t]
                dev_ids = ids.to(dev.device)  # a GPU's pages go through host memory
                if self._chunk == 1:
                    host = host.select(1, 0)
                    if store:
                        host.index_copy_(0, slot_ids, dev.index_select(0, dev_ids).cpu())
                    else:
                        dev.index_copy_(0, dev_ids, host.index_select(0, slot_ids).to(dev.device))
                elif store:
                    host.index_put_((slot_ids, pages), dev.index_select(0, dev_ids).cpu())
                else:
                    dev.index_copy_(0, dev_ids, host[slot_ids, pages].to(dev.device))
                nbytes += len(dev_ids) * dev.shape[1]
        return nbytes

    def _plan(
        self, device: GPULoadStoreSpec, pool: CPULoadStoreSpec
    ) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per KV cache group of the spec: its tensors, device blocks, and for each
        block the slot and the page in it (module docstring); raises ValueError on
        a spec whose blocks and slots do not match."""
        sizes, starts = list(device.group_sizes), list(device.block_indices)
        if len(sizes) != len(self._group_tensors):
            raise ValueError(f"{len(sizes)} KV cache groups, not {len(self._group_tensors)}")
        blocks, slots, plan = 0, 0, []
        for tensors, size, start in zip(self._group_tensors, sizes, starts, strict=True):
            if size == 0:
                continue
            at = np.arange(size, dtype=np.int64) + start % self._chunk
            group_slots = pool.block_ids[slots : slots + int(at[-1]) // self._chunk + 1]
            ids = device.block_ids[blocks : blocks + size].astype(np.int64)
            plan.append((tensors, torch.from_numpy(ids),
                         torch.from_numpy(group_slots.astype(np.int64)[at // self._chunk]),
                         torch.from_numpy(at % self._chunk)))  # fmt: skip
            blocks, slots = blocks + size, slots + len(group_slots)
        if blocks != len(device.block_ids) or slots != len(pool.block_ids):
            raise ValueError(
                f"{len(device.block_ids)} device blocks and {len(pool.block_ids)} slots "
                f"do not match (groups {sizes}, {self._chunk} blocks a chunk)"
            )
        return plan

    def _segment(self, generation: int) -> tuple[Mapping, list[torch.Tensor]]:
        """The mapped segment of `generation`, mapping it by name if need be;
        raises KvdError if it is gone or cannot be mapped."""
        if generation not in self._segments:
            try:
                self._map_by_name(generation)
            except posix_ipc.ExistentialError as exc:
                raise KvdError(
                    f"the pool's segment of generation {generation} is gone (its daemon ended)"
                ) from exc
            except (posix_ipc.Error, OSError, ValueError, KvdError) as exc:  # BadSegment
                raise KvdError(
                    f"worker rank {self._rank} cannot map pool {self._pool!r} "
                    f"(generation {generation}): {exc}"
                ) from exc
        return self._segments[generation]

    def _load_error(self, job_id: int, device: GPULoadStoreSpec) -> None:
        self.load_errors.update(int(b) for b in device.block_ids)
        self.failed_loads.add(job_id)

    def take_failed_loads(self) -> set[int]:
        """The jobs of the loads not served since the last call."""
        failed, self.failed_loads = self.failed_loads, set()
        return failed

    def take_copies(self) -> dict[int, bool]:
        """Store copies since the last call, by token: True if copied."""
        copies, self._copies = self._copies, {}
        return copies

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def get_finished(self) -> list[TransferResult]:
        done, self._results = self._results, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # copies finish inside submit_*

    def shutdown(self) -> None:
        self._conn.close()
        while self._segments:
            _, (mapping, views) = self._segments.popitem()
            del views
            mapping.close()


class IdleWorker(OffloadingWorker):
    """The worker of an engine kvd cannot hold: the manager is off, so no job comes;
    one that did would be answered at once, a load as not served (`load_errors`)."""

    def __init__(self) -> None:
        self._results: list[TransferResult] = []
        self.load_errors: set[int] = set()
        self.failed_loads: set[int] = set()
        self.reports_load_errors = False

    def note(self, notes: StepNotes | None) -> None:
        return

    def take_failed_loads(self) -> set[int]:
        failed, self.failed_loads = self.failed_loads, set()
        return failed

    def take_copies(self) -> dict[int, bool]:
        return {}

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._results.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        self.load_errors.update(int(b) for b in dst_spec.block_ids)
        self.failed_loads.add(job_id)
        self._results.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def get_finished(self) -> list[TransferResult]:
        done, self._results = self._results, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return
