"""Runs in SGLang's scheduler processes: `KvdHiCacheStorage`, SGLang's HiCache storage over kvd.

SGLang's `dynamic` backend builds it (`KvdHiCacheStorage(storage_config,
kwargs)`), then registers the host pool (`register_mem_pool_host`), which is
when kvd's pool is chosen (`pages.choose_pool`) and a `kvd_client.Scheduler`
session opens. SGLang's cache controller then calls it from its threads:

- prefetch thread: `batch_exists` (leading hits, from the pool's ready
  table: no round trip, SPEC section 15; a short answer asks the daemon when
  it has a disk or remote tier, and waits briefly while it reads), then `batch_get_v1(keys,
  host_indices)`: the leading hits pinned in one round trip, copied slot ->
  host page as one job of kvd's CPU backend (`segments`), released;
- backup thread: `batch_set_v1(keys, host_indices)`: `prepare_store`, one
  copy host page -> slot, `complete_store` (only the rank that writes:
  every rank of an MHA engine in its own pool, rank 0 of an MLA engine).

Failure rules (SPEC section 12, as the vLLM plug-in): no exception leaves
these methods, since one kills SGLang's controller thread (sglang #38428).
With the daemon down or unreachable, lookups and loads miss (`False`, 0) and
stores are skipped (`False`); every call returns within the session's
`kvd_timeout_ms` (1000 by default) per round trip, and the session
reconnects and re-attaches in the background (`kvd_client.Scheduler`). A
copy runs only while the session that pinned or prepared its slots is
known alive (`Scheduler.alive_since`): one rolled back since may have lost
its slots to another engine.

Extra-config keys besides SGLang's: `kvd_endpoint`, `kvd_pool`,
`kvd_capacity_bytes`, `kvd_model`, `kvd_timeout_ms`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from kvd_client.scheduler import Scheduler
from kvd_client.sglang.boundary import FailureLog
from kvd_client.sglang.keys import kvd_keys
from kvd_client.sglang.pages import PoolChoice, choose_pool, page_bytes, page_views
from kvd_client.sglang.segments import Segment, Segments

log = logging.getLogger("kvd_client.sglang")
DEFAULT_TIMEOUT_MS = 1000
# `batch_exists` asks again while the daemon answers "retry later" (a block
# another engine is storing, or the disk or remote tier reading the rest into
# RAM), on SGLang's prefetch thread, for at most this long; then a miss.
RETRY_WAIT_S = 0.5
RETRY_EVERY_S = 0.002


class KvdHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        self.timeout_ms = int(self.extra.get("kvd_timeout_ms", DEFAULT_TIMEOUT_MS))
        self.choice: PoolChoice | None = None
        self.scheduler: Scheduler | None = None
        self._segments: Segments | None = None
        self._page_size = 1
        self._page_bytes = 0
        self._failures = FailureLog(log)
        self._stats_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []

    # -- attach ------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Chooses the pool from the host pool and opens the session. A host pool kvd
        cannot map raises (SGLang's attach fails, at start, clearly); a daemon that
        refuses the pool leaves kvd off (every call a miss), in one log line."""
        super().register_mem_pool_host(mem_pool_host)
        pages = page_views(mem_pool_host)
        choice = choose_pool(self.storage_config, mem_pool_host)
        self._page_size = int(mem_pool_host.page_size)
        self._page_bytes = page_bytes(mem_pool_host)
        self._segments = Segments(pages, choice.rank, choice.layout.replicated)
        self.choice = choice
        engine_id = f"sglang-{socket.gethostname()}-{os.getpid()}-tp{self.storage_config.tp_rank}"
        try:
            self.scheduler = Scheduler(
                choice.name,
                choice.layout,
                engine_id=engine_id[:128],
                endpoint=choice.endpoint,
                capacity_bytes=choice.capacity_bytes,
                timeout_ms=self.timeout_ms,
            )
        except Exception as exc:  # refused at attach (layout mismatch, too large): kvd off
            log.error("kvd HiCache storage off: pool %r refused: %s", choice.name, exc)
            self.scheduler = None
            return
        log.info("kvd HiCache storage: pool %s, %d-byte pages of %d tokens, %s",
                 choice.name, self._page_bytes, self._page_size,
                 "writer" if choice.writer else "reader")  # fmt: skip

    @property
    def connected(self) -> bool:
        return self.scheduler is not None and self.scheduler.connected

    def _session(self) -> tuple[Scheduler, Segment] | None:
        """The session and the mapped segment of its pool's generation; None when off."""
        sched, segments = self.scheduler, self._segments
        if sched is None or segments is None or not sched.connected:
            return None
        attached = sched.attached
        if attached is None:
            return None
        return sched, segments.get(attached)

    def _page_ids(self, host_indices: torch.Tensor, n: int) -> list[int]:
        ps = self._page_size
        if host_indices.numel() != n * ps:
            raise ValueError(f"{host_indices.numel()} host indices for {n} pages of {ps}")
        return (host_indices.reshape(n, ps)[:, 0] // ps).tolist()

    @staticmethod
    def _still_ours(sched: Scheduler, seg: Segment, epoch: int) -> bool:
        """Whether the session of `epoch` still holds what it pinned or prepared in `seg`."""
        alive_epoch, t = sched.alive_since()
        attached = sched.attached
        return (
            sched.epoch == epoch
            and alive_epoch == epoch
            and attached is not None
            and attached.generation == seg.generation
            and time.monotonic() - t < sched.lease_s / 2
        )

    # -- zero copy: SGLang's host pool pages <-> slots ---------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        try:
            return self._get_pages(keys, host_indices)
        except Exception as exc:
            self._failures.note("load", exc, "missed")
            return [False] * len(keys)

    def _get_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        n = len(keys)
        session = self._session()
        if session is None or n == 0:
            return [False] * n
        sched, seg = session
        pages = self._page_ids(host_indices, n)
        kk = kvd_keys(keys)
        epoch = sched.epoch
        start = time.perf_counter()
        hits, spec = sched.lookup_and_pin(kk)
        hits = len(spec.slots) if hits else 0
        if hits == 0:
            return [False] * n
        try:
            if not self._still_ours(sched, seg, epoch):
                return [False] * n
            error = seg.copy("load", pages[:hits], spec.slots[:hits])
        finally:
            sched.complete_load(kk[:hits])
        if error is not None:
            self._failures.note("load copy", error, "missed")
            return [False] * n
        self._record(self._prefetch_pgs, self._prefetch_bw, hits, start)
        return [True] * hits + [False] * (n - hits)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        try:
            return self._set_pages(keys, host_indices)
        except Exception as exc:
            self._failures.note("store", exc, "skipped")
            return [False] * len(keys)

    def _set_pages(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        n = len(keys)
        choice = self.choice
        if choice is not None and not choice.writer:
            return [True] * n  # rank 0 writes the replicated copy
        session = self._session()
        if session is None or n == 0:
            return [False] * n
        sched, seg = session
        pages = self._page_ids(host_indices, n)
        kk = kvd_keys(keys)
        epoch = sched.epoch
        start = time.perf_counter()
        out = sched.prepare_store(kk)
        if out is None:
            return [False] * n  # nothing fits (every slot pinned or in flight), or down
        stored = out.keys_to_store
        if not stored:
            return [True] * n  # all there already (this engine's or another's)
        if len(stored) == n:
            todo = pages
        else:
            where = {k: i for i, k in enumerate(kk)}
            todo = [pages[where[k]] for k in stored]
        ok = False
        try:
            if self._still_ours(sched, seg, epoch):
                error = seg.copy("store", todo, out.store_spec.slots)
                ok = error is None
                if error is not None:
                    self._failures.note("store copy", error, "skipped")
        finally:
            sched.complete_store(stored, ok)
        if ok:
            self._record(self._backup_pgs, self._backup_bw, len(stored), start)
        return [ok] * n

    # -- SGLang's copying interface: flat pages ----------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Fills each of `target_locations` (SGLang's flat pages) with its key's page;
        None for that key and every one after the first miss."""
        try:
            return self._get_flat(keys, list(target_locations or []))
        except Exception as exc:
            self._failures.note("load", exc, "missed")
            return [None] * len(keys)

    def _get_flat(self, keys: list[str], targets: list[Any]) -> list[torch.Tensor | None]:
        n = len(keys)
        session = self._session()
        if session is None or n == 0 or len(targets) != n:
            return [None] * n
        sched, seg = session
        kk = kvd_keys(keys)
        epoch = sched.epoch
        hits, spec = sched.lookup_and_pin(kk)
        hits = len(spec.slots) if hits else 0
        found: list[torch.Tensor | None] = [None] * n
        try:
            with seg.lock:
                slots = seg.slots
                if slots is None or not self._still_ours(sched, seg, epoch):
                    return found
                for i in range(hits):  # SGLang's copying path: one page per tensor
                    t = targets[i]
                    if t is None or t.nbytes != self._page_bytes or not t.is_contiguous():
                        break
                    t.view(-1).view(torch.uint8).copy_(slots[spec.slots[i]])
                    found[i] = t
        finally:
            if hits:
                sched.complete_load(kk[:hits])
        return found

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Stores SGLang's flat pages `values` under `keys`; whether all are stored."""
        try:
            return self._set_flat(keys, list(values or []))
        except Exception as exc:
            self._failures.note("store", exc, "skipped")
            return False

    def _set_flat(self, keys: list[str], values: list[Any]) -> bool:
        n = len(keys)
        if self.choice is not None and not self.choice.writer:
            return True
        session = self._session()
        if session is None or n == 0 or len(values) != n:
            return False
        if any(v is None or v.nbytes != self._page_bytes for v in values):
            raise ValueError(f"pages must be {self._page_bytes} bytes")
        sched, seg = session
        kk = kvd_keys(keys)
        epoch = sched.epoch
        out = sched.prepare_store(kk)
        if out is None:
            return False
        where = {k: i for i, k in enumerate(kk)}
        ok = False
        try:
            with seg.lock:
                slots = seg.slots
                if slots is not None and self._still_ours(sched, seg, epoch):
                    for key, slot in zip(out.keys_to_store, out.store_spec.slots, strict=True):
                        v = values[where[key]].contiguous().view(-1).view(torch.uint8)
                        slots[slot].copy_(v)
                    ok = True
        finally:
            if out.keys_to_store:
                sched.complete_store(out.keys_to_store, ok)
        return ok

    # -- lookups -----------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Leading keys ready in the pool, read from its ready table (no round trip
        where the daemon publishes one); 0 when off or down. While the daemon
        answers "retry later" (the next key being stored, or read back from its
        disk or remote tier) it asks again, for RETRY_WAIT_S at most."""
        try:
            sched = self.scheduler
            if sched is None or not keys:
                return 0
            ks = kvd_keys(keys)
            hits = sched.lookup(ks)
            deadline = time.monotonic() + RETRY_WAIT_S
            while hits is None and time.monotonic() < deadline:
                time.sleep(RETRY_EVERY_S)
                hits = sched.lookup(ks)
            return hits or 0
        except Exception as exc:
            self._failures.note("lookup", exc, "missed")
            return 0

    # -- the rest ----------------------------------------------------------------

    def clear(self) -> bool:
        """Empties the pool, for every engine that shares it (SGLang's
        /clear_hicache_storage_backend); False when the daemon cannot be reached."""
        try:
            sched, choice = self.scheduler, self.choice
            if sched is None or choice is None or not sched.connected:
                return False
            sched.reset()
            return True
        except Exception as exc:
            self._failures.note("clear", exc, "not cleared")
            return False

    def _record(self, pgs: list[int], bw: list[float], n: int, start: float) -> None:
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._stats_lock:
            pgs.append(n)
            bw.append(n * self._page_bytes / seconds / 1e9)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call: pages per prefetch and backup
        call, and their GB/s (keys, pin or prepare, copy, release)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._stats_lock:
            metrics = StorageMetrics(
                prefetch_pgs=self._prefetch_pgs,
                backup_pgs=self._backup_pgs,
                prefetch_bandwidth=self._prefetch_bw,
                backup_bandwidth=self._backup_bw,
            )
            self._prefetch_pgs, self._backup_pgs = [], []
            self._prefetch_bw, self._backup_bw = [], []
        return metrics

    def close(self) -> None:
        """Ends the session and unmaps the pool (SGLang's detach calls it)."""
        sched, segments = self.scheduler, self._segments
        self.scheduler = None
        if sched is not None:
            sched.close()
        if segments is not None:
            segments.close()


__all__ = ["KvdHiCacheStorage"]
