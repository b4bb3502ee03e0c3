"""Runs in a TP worker: the native block copier (`kvd_client._blockcopy`), when it was built.

`BlockCopier` moves every layer's page of a job's block pairs in one C call
that releases the GIL: no torch indexing, no staging, one pass over the
bytes. It sorts the pairs by device block, so each layer's device pages go
in address order and each pool slot is copied whole, and writes with
streaming stores. `_blockcopy.c` says why that pays.

It pays only for jobs too large to stay in cache: streaming stores go to
memory even when the destination would have fit in cache, where plain
stores (torch's copies) are faster. `native_min_bytes` is where the CPU
backend switches: `KVD_NATIVE_MIN_BYTES` where set (0 sends every job
native; read by `kvd_client.settings` and passed down), else a quarter of
the last-level cache.

On the development VM (a 480 MiB last-level cache, shared with other
guests; `kvd bench transfer --total-mb N --copier native|torch`), torch was
ahead at 32 and 64 MiB per job; at 128 MiB the native copier led on
32-layer slots (0.84 against 0.55 of memcpy at 16 KiB) and trailed by up to
0.05 on contiguous ones; from 192 MiB it led or tied everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from kvd_client.backends.views import BlockViews, id_tensor

_blockcopy: ModuleType | None
try:
    from kvd_client import _blockcopy
except ImportError:  # built without a compiler: the torch paths serve
    _blockcopy = None

# Where the last-level cache size cannot be read: a modest server's quarter.
FALLBACK_NATIVE_MIN_BYTES = 32 << 20
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
# Helper threads (up to torch's thread count) from this many bytes per job;
# starting a thread costs tens of microseconds.
PARALLEL_MIN_BYTES = 1 << 20
MAX_THREADS = 64  # the extension's limit


def available() -> bool:
    """Whether the native copier was built and imports."""
    return _blockcopy is not None


def streaming_kind() -> str:
    """The streaming stores in use ("avx512", "avx2", "sse2"), or "none"."""
    return "none" if _blockcopy is None else _blockcopy.streaming_kind()


def last_level_cache_bytes(caches: Path = CPU_CACHES) -> int | None:
    """The size of the highest-level cache of CPU 0 (Linux sysfs), or None where unknown."""
    best: tuple[int, int] | None = None
    try:
        for index in caches.glob("index*"):
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            size = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
            if best is None or level > best[0]:
                best = (level, size)
    except (OSError, ValueError):
        return None
    return best[1] if best is not None and best[1] > 0 else None


def default_native_min_bytes() -> int:
    """Job size from which jobs go native when not configured: a quarter of the
    last-level cache, or `FALLBACK_NATIVE_MIN_BYTES` where its size is unknown."""
    cache = last_level_cache_bytes()
    return cache // 4 if cache is not None else FALLBACK_NATIVE_MIN_BYTES


def _longs(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class BlockCopier:
    """Page addresses of one rank's device cache and pool slots, per layer.

    Layer l's page of device block d is at `device_base[l] + d * device_stride[l]`,
    and of pool block p at `host_base[l] + p * host_stride[l]`; it is
    `sizes[l]` bytes on both sides.
    """

    views: BlockViews  # keeps every address below alive
    device_base: torch.Tensor
    device_stride: torch.Tensor
    host_base: torch.Tensor
    host_stride: torch.Tensor
    sizes: torch.Tensor
    parallel_min_bytes: int = PARALLEL_MIN_BYTES

    @classmethod
    def build(
        cls, views: BlockViews, *, parallel_min_bytes: int = PARALLEL_MIN_BYTES
    ) -> BlockCopier:
        layout = views.layout
        device_base = list(views.device_ptrs)
        device_stride = [d.stride(0) * d.element_size() for d in views.device]
        host_base = [h.data_ptr() for h in views.host]
        host_stride = [h.stride(0) * h.element_size() for h in views.host]
        return cls(
            views,
            _longs(device_base),
            _longs(device_stride),
            _longs(host_base),
            _longs(host_stride),
            _longs(list(layout.page_bytes)),
            parallel_min_bytes,
        )

    @property
    def num_layers(self) -> int:
        return self.sizes.numel()

    def copy(
        self, store: bool, device_ids: Sequence[int], pool_ids: Sequence[int], threads: int
    ) -> None:
        """Every page of the pairs, which `check_job` has passed, with up to `threads` threads."""
        if _blockcopy is None:
            raise RuntimeError("the native block copier is not built")
        n = len(device_ids)
        if n == 0:
            return
        dev, pool = by_device(id_tensor(device_ids), id_tensor(pool_ids))
        if store:
            dst_ids, src_ids = pool, dev
            dst_base, dst_stride = self.host_base, self.host_stride
            src_base, src_stride = self.device_base, self.device_stride
        else:
            dst_ids, src_ids = dev, pool
            dst_base, dst_stride = self.device_base, self.device_stride
            src_base, src_stride = self.host_base, self.host_stride
        nbytes = n * self.views.layout.slot_bytes
        _blockcopy.copy_blocks(
            n,
            self.num_layers,
            dst_ids.data_ptr(),
            src_ids.data_ptr(),
            dst_base.data_ptr(),
            dst_stride.data_ptr(),
            src_base.data_ptr(),
            src_stride.data_ptr(),
            self.sizes.data_ptr(),
            True,  # streaming stores (pieces of whole, aligned lines)
            max(1, min(threads, MAX_THREADS)) if nbytes >= self.parallel_min_bytes else 1,
        )


def by_device(
    device_ids: torch.Tensor, pool_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ordered by device block (distinct ids, as `check_job` ensures for a load's
    destination; a store's device ids may repeat, and keep their order among equals)."""
    n = device_ids.numel()
    if n < 2 or bool((device_ids[1:] > device_ids[:-1]).all()):
        return device_ids, pool_ids
    lo, hi = int(device_ids.min()), int(device_ids.max())
    if hi - lo + 1 == n:
        # Maybe a shuffled range: then placing each pair at its id sorts in O(n).
        slots = torch.full((n,), -1, dtype=torch.int64)
        slots.scatter_(0, device_ids - lo, torch.arange(n, dtype=torch.int64))
        if bool((slots >= 0).all()):
            return torch.arange(lo, hi + 1, dtype=torch.int64), pool_ids[slots]
    _, order = torch.sort(device_ids, stable=True)
    return device_ids[order], pool_ids[order]


def native_copier(
    views: BlockViews, *, parallel_min_bytes: int = PARALLEL_MIN_BYTES
) -> BlockCopier | None:
    """A copier over `views`, or None when the extension is not built."""
    if _blockcopy is None:
        return None
    return BlockCopier.build(views, parallel_min_bytes=parallel_min_bytes)
