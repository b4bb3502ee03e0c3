"""Runs in a vLLM TP worker: vLLM's `OffloadingWorker`, copying between its KV tensors and kvd.

vLLM hands the worker its canonical KV caches (per tensor a `(num_blocks,
page_bytes)` int8 view) and names the copies on its own transfer channel
(`submit_store` / `submit_load`, with device block ids and the kvd slot ids
and segment generation that the scheduler side got from the daemon). The
copies go through kvd's own transfer backends, the ones `kvd_client.Worker`
uses (`copies`: the layout of a slot, one backend per block of a chunk), and
are asynchronous: `submit_*` launches and returns, `get_finished` reports
the jobs done, `wait(job_ids)` blocks for the named jobs only.

Why kvd's backends and not vLLM's own CPU-GPU handlers over kvd's pinned
views: whichever leaves less code that has never run. vLLM's handlers
(`vllm.v1.kv_offload.cpu.gpu_worker`) need a CUDA build of vLLM, which is
not on the hosts kvd is tested on (the CPU build here; a GPU host that
cannot install vLLM), and they refuse CPU tensors, so the CPU path would be
other code. kvd's CUDA backend is what `tests/gpu/` runs on a GPU host, and
`copies` imports no vLLM, so `tests/gpu/on_device.sh` drives the plug-in's
copies there; the CPU path is the same code over the CPU backend.

On CUDA the backend's side streams and events make the copies asynchronous
(a store waits for the stream that wrote its pages, a load for work queued
on its blocks). On the CPU a copy runs inside `submit_*` ("sync", the
default) or on a thread of its own ("thread"), by vLLM's extra-config key
`kvd_copies`: on 2 cores a decode step while stores run was no faster with
the thread, whose copies contend with the forward pass for the same cores
and memory bandwidth (`kvd bench vllm --parts copies`, docs/benchmarks.md).
vLLM 0.33's expedited loads go before every queued job (on CUDA: on the
next stream, with no stream of their own); vLLM `wait`s for them at once.

The worker keeps the last few segments it mapped, and a job keeps its
segment mapped until it is done: after a cold daemon restart a load pinned
in the old segment still reads it (nobody writes there any more), never the
new one. The daemon completes a store when vLLM's scheduler side says every
rank has finished (`complete_store`).

No exception from kvd leaves the worker (SPEC section 12), and vLLM, which
asserts that every transfer succeeded, is told each one did. What a job
came to is settled when `get_finished` reports it (the connector takes the
failures after it, in the same step): a load the worker cannot serve (its
segment is gone, the manager could not pin it, the copy failed, or it
comes past its deadline) leaves its device blocks in `load_errors` and its
job in `failed_loads`, which `KvdOffloadingConnector` hands to vLLM to
recompute, block by block or per request (the spec turns kvd off under
vLLM's plain connector, which could not). A store copies nothing past its
deadline or once vLLM reset the cache since its prepare (`StepNotes`, each
step from the scheduler side, checked when the copy starts on the CPU; on
CUDA when it is queued on its side stream, which may start it later: a known
gap, docs/known-limits.md), and one whose
copy fails is reported not copied (`take_copies`, by its token), so the
manager completes it as failed: its slots are freed and nobody reads them.
"""

from __future__ import annotations

import logging
import math
import time

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
from kvd_client.vllm.boundary import FailureLog
from kvd_client.vllm.copies import DEFAULT_CPU_MODE, Copies, Done
from kvd_client.vllm.manager import UNSERVABLE, StepNotes

log = logging.getLogger("kvd_client.vllm")


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
        copies: str = DEFAULT_CPU_MODE,
    ) -> None:
        device = [t.tensor.view(torch.int8).view(t.tensor.shape[0], -1)
                  for t in kv_caches.tensors]  # fmt: skip
        page = sum(d.shape[1] for d in device)
        if page * blocks_per_chunk != layout.slot_bytes:
            # The scheduler side is on and would complete stores this worker
            # could not write, so this stops the engine at start, clearly.
            raise BadRequest(
                f"vLLM's pages ({page} bytes a block, {blocks_per_chunk} blocks a "
                f"chunk) do not fill the pool's slot of {layout.slot_bytes} bytes"
            )
        self._copies = Copies(device, rank=rank, replicated=layout.replicated,
                              blocks_per_chunk=blocks_per_chunk,
                              num_groups=len(kv_caches.group_data_refs), mode=copies)  # fmt: skip
        self._rank = rank
        self._layout = layout
        self._pool = pool
        self._capacity = capacity_bytes  # a worker may attach first and create the pool
        self._jobs: dict[int, tuple[str, int, np.ndarray]] = {}  # job -> kind, token, blocks
        self._refused: list[Done] = []  # jobs no copy was started for, not reported yet
        self.load_errors: set[int] = set()  # device blocks of loads not served
        self.failed_loads: set[int] = set()  # their jobs
        self.reports_load_errors = False  # set by KvdOffloadingConnector
        self._notes: StepNotes | None = None  # this step's, from the scheduler side
        self._copied: dict[int, bool] = {}  # store token -> copied, not reported yet
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

    @property
    def copy_mode(self) -> str:
        """How copies run (`copies`): "device" (CUDA), "thread" or "sync" (CPU)."""
        return self._copies.mode

    def _attach(self, conn: Connection) -> None:
        reply = conn.call(p.Attach, self._pool, self._layout, self._capacity)
        assert isinstance(reply, p.Attached)
        try:
            self._copies.map(reply)
        except (posix_ipc.Error, OSError, ValueError, RuntimeError, KvdError) as exc:
            # A KvdError: the keeper and the start log it and go on.
            raise KvdError(
                f"worker rank {self._rank} cannot map pool {self._pool!r}: {exc}"
            ) from exc

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
        self._submit(job_id, "store", src_spec, dst_spec, expedited=False)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """vLLM 0.33 passes `expedited=True` for a sync load (`sync_load_budget_bytes`):
        its request runs this very step, and vLLM calls `wait()` on it at once, so it
        goes before the jobs queued (`copies`). A sync load not served goes to
        `load_errors` like any other, and vLLM 0.33 recomputes it (one KV cache
        group: `invalid_block_ids` of a running request)."""
        self._submit(job_id, "load", dst_spec, src_spec, expedited=expedited)
        return True

    def _submit(
        self,
        job_id: int,
        kind: str,
        device: GPULoadStoreSpec,
        pool: LoadStoreSpec,
        *,
        expedited: bool,
    ) -> None:
        """Launches a copy; whatever stops it is the job's failure, reported with
        it by `get_finished`. Never raises (the boundary: a store not completed, a
        load recomputed, never an engine stopped)."""
        token = getattr(pool, "token", 0) if kind == "store" else 0
        try:
            self._jobs[job_id] = (kind, token, np.asarray(device.block_ids, dtype=np.int64))
            generation = getattr(pool, "generation", UNSERVABLE)
            if kind == "load" and generation == UNSERVABLE:
                # The manager could not pin it, and counted it: no log line.
                self._refused.append(Done(job_id, False, 0, 0.0, None, refused=True))
                return
            if (why := self._late(pool)) is not None:
                self._refused.append(Done(job_id, False, 0, 0.0, why, refused=True))
                return
            assert isinstance(pool, CPULoadStoreSpec)
            plan = self._copies.plan(device.block_ids, device.group_sizes,
                                     device.block_indices, pool.block_ids)  # fmt: skip
            if not plan:  # nothing to copy, no segment to map
                self._refused.append(Done(job_id, True, 0, 0.0))
                return
            self._segment(generation)
            self._copies.submit(job_id, kind == "store", generation, plan,
                                check=lambda: self._late(pool), expedited=expedited)  # fmt: skip
        except Exception as exc:
            self._refused.append(Done(job_id, False, 0, 0.0, f"{type(exc).__name__}: {exc}"))

    def _segment(self, generation: int) -> None:
        """Maps the pool's segment of `generation` by name if need be; raises
        KvdError if it is gone or cannot be mapped."""
        if self._copies.has(generation):
            return
        try:
            self._copies.map_by_name(self._pool, generation)
        except posix_ipc.ExistentialError as exc:
            raise KvdError(
                f"the pool's segment of generation {generation} is gone (its daemon ended)"
            ) from exc
        except (posix_ipc.Error, OSError, ValueError, RuntimeError, KvdError) as exc:
            raise KvdError(
                f"worker rank {self._rank} cannot map pool {self._pool!r} "
                f"(generation {generation}): {exc}"
            ) from exc

    def get_finished(self) -> list[TransferResult]:
        """The jobs done since the last call, each reported a success to vLLM; what
        each came to is recorded now (`take_copies`, `load_errors`)."""
        try:
            done = self._copies.poll()
        except Exception as exc:  # never into vLLM; the jobs are reported by a later call
            self._failures.note("copies", f"poll: {exc}", "retried next step")
            done = []
        done, self._refused = self._refused + done, []
        for d in done:
            self._settle(d)
        return [TransferResult(d.job_id, True, d.nbytes, d.seconds) for d in done]

    def _settle(self, done: Done) -> None:
        kind, token, blocks = self._jobs.pop(done.job_id, ("", 0, np.empty(0, np.int64)))
        outcome = "refused" if done.refused else None
        if kind == "store":
            if token:
                self._copied[token] = done.ok
            if not done.ok:
                self._failures.note("store copy", f"job {done.job_id}: {done.error}",
                                    outcome or "store not completed")  # fmt: skip
        elif kind == "load" and not done.ok:
            if done.error is not None:
                self._failures.note("load copy", f"job {done.job_id}: {done.error}", "recomputed")
            self.load_errors.update(int(b) for b in blocks)
            self.failed_loads.add(done.job_id)

    def take_failed_loads(self) -> set[int]:
        """The jobs of the loads not served, of those `get_finished` reported."""
        failed, self.failed_loads = self.failed_loads, set()
        return failed

    def take_copies(self) -> dict[int, bool]:
        """Store copies `get_finished` reported, by token: True if copied."""
        copies, self._copied = self._copied, {}
        return copies

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until the named jobs are done (`get_finished` reports them)."""
        try:
            self._copies.wait(job_ids)
        except Exception as exc:  # a CUDA error: the job's event reports it
            self._failures.note("copies", f"wait for {sorted(job_ids)}: {exc}", "reported")

    def shutdown(self) -> None:
        self._conn.close()
        self._copies.close()


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
