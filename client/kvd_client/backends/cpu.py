"""Runs in a TP worker: the CPU backend, copies between CPU tensors and the mapped pool.

The reference backend and the CI path. It copies synchronously inside
`submit`: on a CPU host the forward pass is over when a store is submitted,
and a background thread would only compete with it for the cores.

SPEC section 10 asks for close to the speed of one contiguous copy of the
same bytes. A job too large to stay in cache (`native_min_bytes`, a
quarter of the last-level cache) is one call to the native copier, whatever
its layout or pattern, where it was built (`native`, the default; see
`native` for why and the measurements). Other jobs, and every job without
it (no C compiler at install, or `native=False`), take torch copies, their
pairs in this order (primitives in `views`):

1. runs (pairs consecutive on both sides, `copy_plan`) of `direct_min_bytes`
   per layer and more: one `copy_` per layer per run, as fast as memcpy;
2. per-layer caches with a `LayerSpan`, pairs sorted by pool block: per
   stretch of consecutive pool blocks ("segment"), one gather (store) or one
   16-byte scatter (load, pages of 4 KiB and up) of whole slots;
3. sorted by destination block: per segment, one gather per layer, written
   in place into the stretch (the common case: stores fill fresh slots,
   loads fill fresh device blocks):

       store, pool ids 7 8 9 <- device ids 4 0 9:
       host rows 7..9 (one strided view) = index_select(device pages, [4, 0, 9])

4. destinations scattered, sources in segments: one scatter per layer;
5. both sides scattered: pages of `pair_min_bytes` one `copy_` each, smaller
   ones through a staging buffer that stays in cache, a gather into it and a
   scatter out of it, chunk by chunk (one call each with a `LayerSpan`).

A segment costs one call per layer, so segments only pay off when they move
`segment_min_bytes` per call; a job that is one shuffled stretch (a
permutation) is found without sorting.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from kvd_client.backends.base import CopyJob, CopyResult, TransferBackend
from kvd_client.backends.native import (
    PARALLEL_MIN_BYTES,
    default_native_min_bytes,
    native_copier,
)
from kvd_client.backends.views import (
    BlockViews,
    KvCaches,
    LayerSpan,
    gather_pages,
    id_tensor,
    wide_index_copy,
)
from kvd_client.copy_plan import CopyPlan
from kvd_client.errors import BadRequest, KvdError
from kvd_client.geometry import Geometry

if TYPE_CHECKING:
    from typing_extensions import Buffer

# A run copies on its own (one `copy_` per layer) from this many bytes per
# layer; shorter runs join the gathers, which pay one call per segment.
DIRECT_MIN_BYTES = 4 << 20
# Gathers per segment pay off once a segment moves this much per call.
SEGMENT_MIN_BYTES = 64 << 10
# Loads scatter whole slots through a LayerSpan from this page size up; below
# it, per-row overhead makes per-layer gathers faster.
SPAN_LOAD_MIN_PAGE = 4 << 10
# Scattered pages this large are copied one `copy_` each: one pass, where
# staging takes two.
PAIR_MIN_BYTES = 1 << 20
# Large enough to amortize a few calls per chunk, small enough that the
# second pass of a staged copy still reads from cache.
STAGING_BYTES = 8 << 20


class CpuBackend(TransferBackend):
    """Copies synchronously in `submit`; `poll` and `wait` hand out the results."""

    def __init__(
        self,
        kv_caches: KvCaches,
        region: Buffer,
        geometry: Geometry,
        rank: int,
        *,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
        segment_min_bytes: int = SEGMENT_MIN_BYTES,
        pair_min_bytes: int = PAIR_MIN_BYTES,
        staging_bytes: int = STAGING_BYTES,
        layer_span: bool = True,
        native: bool = True,
        native_min_bytes: int | None = None,
        threads: int | None = None,
        parallel_min_bytes: int = PARALLEL_MIN_BYTES,
        part: int = 0,
        parts: int = 1,
    ) -> None:
        views = BlockViews.build(kv_caches, region, geometry, rank, part=part, parts=parts)
        if views.device[0].device.type != "cpu":
            raise BadRequest(f"the CPU backend needs CPU tensors, not {views.device[0].device}")
        self.views: BlockViews | None = views
        # The native copier's threads: None follows torch's thread count.
        self._threads = threads
        self.native = (
            native_copier(views, parallel_min_bytes=parallel_min_bytes) if native else None
        )
        # Jobs of this many bytes and more go native (None: a quarter of the LLC).
        self.native_min_bytes = (
            default_native_min_bytes() if native_min_bytes is None else native_min_bytes
        )
        self._span = LayerSpan.build(views) if layer_span else None
        # A 16-byte scatter beats per-layer gathers from pages of 4 KiB up.
        self._span_loads = (
            self._span is not None
            and self._span.flat.dtype == torch.complex128
            and min(views.layout.page_bytes) >= SPAN_LOAD_MIN_PAGE
        )
        self._pair_min_bytes = pair_min_bytes
        self._min_run = views.min_run(direct_min_bytes)
        self._min_segment = views.min_run(segment_min_bytes)
        self._staging_rows = max(1, staging_bytes // views.layout.slot_bytes)
        self._staging: torch.Tensor | None = None
        self._results: deque[CopyResult] = deque()

    def copier_for(self, nbytes: int) -> str:
        """Which copier a job of `nbytes` takes: "native" or "torch"."""
        return "native" if self.native is not None and nbytes >= self.native_min_bytes else "torch"

    # -- TransferBackend -------------------------------------------------------

    def submit(self, job: CopyJob) -> None:
        views = self.views
        if views is None:
            raise BadRequest("the backend is closed")
        start = time.perf_counter()
        try:
            nbytes = self._submit(views, job)
        except (KvdError, RuntimeError) as exc:
            # KvdError: refused before any copy. RuntimeError: torch failed
            # midway (out of memory for an index tensor); the job fails whole.
            self._results.append(
                CopyResult(job.job_id, False, 0, time.perf_counter() - start, str(exc))
            )
            return
        self._results.append(CopyResult(job.job_id, True, nbytes, time.perf_counter() - start))

    def _submit(self, views: BlockViews, job: CopyJob) -> int:
        """Copies `job` (a store only where this rank writes); the bytes moved."""
        nbytes = len(job.device_block_ids) * views.layout.slot_bytes
        native = self.native if self.copier_for(nbytes) == "native" else None
        if native is not None:
            views.check(job)  # all the native copier needs: no plan
            plan = None
        else:
            plan = views.plan(job)
        if job.kind == "store" and not job.writer:
            return 0
        if native is not None:
            native.copy(
                job.kind == "store",
                job.device_block_ids,
                job.pool_block_ids,
                self._threads or torch.get_num_threads(),
            )
        else:
            assert plan is not None
            self._copy(views, plan)
        return nbytes

    def poll(self) -> list[CopyResult]:
        done = list(self._results)
        self._results.clear()
        return done

    def wait(self, job_ids: Iterable[int]) -> list[CopyResult]:
        by_id = {r.job_id: r for r in self._results}
        done = [by_id.pop(j) for j in dict.fromkeys(job_ids) if j in by_id]
        if done:
            self._results = deque(r for r in self._results if r.job_id in by_id)
        return done

    def close(self) -> None:
        # Dropping every view releases the region's buffer export, so its
        # owner can unmap it.
        self.views = None
        self.native = None
        self._span = None
        self._staging = None
        self._results.clear()

    # -- copies ----------------------------------------------------------------

    def _copy(self, views: BlockViews, plan: CopyPlan) -> None:
        store = plan.kind == "store"
        runs, device_ids, pool_ids = plan.split(self._min_run)
        for run in runs:
            for dev, host in zip(views.device, views.host, strict=True):
                d = dev.narrow(0, run.device_start, run.count)
                h = host.narrow(0, run.pool_start, run.count)
                if store:
                    h.copy_(d)
                else:
                    d.copy_(h)
        if not device_ids:
            return
        dev_idx, pool_idx = id_tensor(device_ids), id_tensor(pool_ids)
        dst_idx, src_idx = (pool_idx, dev_idx) if store else (dev_idx, pool_idx)
        span = self._span
        if span is not None and not store and self._span_loads:
            # Whole slots per call, read in pool order: one 16-byte scatter.
            pool_segments = self._segments(pool_idx, dev_idx)
            if pool_segments is not None:
                for first, devices in pool_segments:
                    span.load(first, devices)
                return
        segments = self._segments(dst_idx, src_idx)
        if segments is not None and span is not None and store:
            # Whole slots per call, written in pool order: one gather.
            for first, devices in segments:
                span.store(first, devices)
            return
        if segments is not None:
            src_views, dst_views = (
                (views.device, views.host) if store else (views.host, views.device)
            )
            flat = views.device_flat if store else [views.host_flat] * len(views.host)
            for first, src in segments:
                for s, f, d in zip(src_views, flat, dst_views, strict=True):
                    gather_pages(s, f, src, d.narrow(0, first, src.numel()))
            return
        segments = self._segments(src_idx, dst_idx)
        if segments is not None:
            self._scatter(views, store, segments)
            return
        self._staged(views, store, dev_idx, pool_idx)

    def _scatter(
        self, views: BlockViews, store: bool, segments: list[tuple[int, torch.Tensor]]
    ) -> None:
        """Each stretch of consecutive source blocks, read whole, to scattered destinations."""
        src_views, dst_views = (views.device, views.host) if store else (views.host, views.device)
        for first, dst in segments:
            for s, d in zip(src_views, dst_views, strict=True):
                wide_index_copy(d, dst, s.narrow(0, first, dst.numel()))

    def _segments(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> list[tuple[int, torch.Tensor]] | None:
        """Stretches of consecutive `keys`, each as (first key, the `values` there in key order).

        None when the stretches are too short to be worth one call each.
        """
        n = keys.numel()
        lo, hi = int(keys.min()), int(keys.max())
        if hi - lo + 1 == n and self._distinct(keys, lo, n):
            # One stretch, in some order: invert the permutation, no sort.
            ordered = torch.empty(n, dtype=torch.int64)
            ordered.scatter_(0, keys - lo, values)
            return [(lo, ordered)]
        keys_sorted, order = torch.sort(keys)
        cuts = torch.nonzero(keys_sorted[1:] - keys_sorted[:-1] != 1).flatten().add_(1).tolist()
        if n < self._min_segment * (len(cuts) + 1):
            return None
        bounds = [0, *cuts, n]
        firsts = keys_sorted[bounds[:-1]].tolist()
        values = values[order]
        return [(f, values[a:b]) for f, a, b in zip(firsts, bounds, bounds[1:], strict=False)]

    @staticmethod
    def _distinct(keys: torch.Tensor, lo: int, n: int) -> bool:
        """Whether `keys`, all in `[lo, lo + n)`, are all different (a permutation)."""
        seen = torch.zeros(n, dtype=torch.bool)
        seen.index_fill_(0, keys - lo, True)
        return bool(seen.all())

    def _staged(
        self, views: BlockViews, store: bool, dev_idx: torch.Tensor, pool_idx: torch.Tensor
    ) -> None:
        """Both sides scattered. Pages of `pair_min_bytes` go one `copy_` each;
        smaller ones through a staging buffer laid out like the slots, chunk by
        chunk: a gather into it, a scatter out of it, the chunk still in cache."""
        if min(views.layout.page_bytes) >= self._pair_min_bytes:
            for d, p in zip(dev_idx.tolist(), pool_idx.tolist(), strict=True):
                for dev, host in zip(views.device, views.host, strict=True):
                    if store:
                        host[p].copy_(dev[d])
                    else:
                        dev[d].copy_(host[p])
            return
        if self._staging is None:
            slot_bytes = views.layout.slot_bytes
            self._staging = torch.empty(self._staging_rows, slot_bytes, dtype=torch.uint8)
        staging = self._staging.view(views.dtype)
        item = views.dtype.itemsize
        layers = [
            staging.narrow(1, off // item, host.shape[1])
            for off, host in zip(views.layout.layer_offsets, views.host, strict=True)
        ]
        span = self._span
        rows = self._staging_rows
        for first in range(0, dev_idx.numel(), rows):
            d_idx = dev_idx[first : first + rows]
            p_idx = pool_idx[first : first + rows]
            k = d_idx.numel()
            if store:
                if span is not None:  # one call fills whole slots
                    span.store_into(self._staging[:k], d_idx)
                else:
                    for flat, dev, stage in zip(
                        views.device_flat, views.device, layers, strict=True
                    ):
                        gather_pages(dev, flat, d_idx, stage[:k])
                wide_index_copy(views.slots, p_idx, staging[:k])
            else:
                gather_pages(views.slots, views.host_flat, p_idx, staging[:k])
                if span is not None:  # one call drains whole slots
                    span.load_from(self._staging[:k], d_idx)
                else:
                    for dev, stage in zip(views.device, layers, strict=True):
                        wide_index_copy(dev, d_idx, stage[:k])
