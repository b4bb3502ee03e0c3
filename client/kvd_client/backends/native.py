"""Runs in a TP worker: the native block copier (`kvd_client._blockcopy`), when it was built.

`BlockCopier` moves every layer's page of a job's block pairs in one C call
that releases the GIL: no torch indexing, no staging, one pass over the
bytes. It sorts the pairs by device block, so each layer's device pages go
in address order and each pool slot is copied whole, and asks for streaming
stores when a job is large enough that its destination would not stay in
cache anyway. `_blockcopy.c` says why that pays.

Addresses go to C as plain integers, so everything is checked first: ids by
`copy_plan.check_job` (the caller's, before `copy`), and each page address
from the views `BlockViews` built over the very tensors and region in use.
The copier holds references to those views, and the backend drops it with
them in `close()`.

The extension is optional (`client/pyproject.toml`): without a C compiler
the package installs without it and `native_copier` returns None, and the
CPU backend copies with torch alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvd_client.backends.views import BlockViews, id_tensor

_blockcopy: ModuleType | None
try:
    from kvd_client import _blockcopy
except ImportError:  # built without a compiler: the torch paths serve
    _blockcopy = None

# Streaming stores from this many bytes per job: below it the destination
# may still be in cache when the engine reads it.
STREAMING_MIN_BYTES = 1 << 20
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
    streaming_min_bytes: int = STREAMING_MIN_BYTES
    parallel_min_bytes: int = PARALLEL_MIN_BYTES

    @classmethod
    def build(
        cls,
        views: BlockViews,
        *,
        streaming_min_bytes: int = STREAMING_MIN_BYTES,
        parallel_min_bytes: int = PARALLEL_MIN_BYTES,
    ) -> BlockCopier:
        layout = views.layout
        device_base = [d.data_ptr() for d in views.device]
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
            streaming_min_bytes,
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
            nbytes >= self.streaming_min_bytes,
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
    views: BlockViews,
    *,
    streaming_min_bytes: int = STREAMING_MIN_BYTES,
    parallel_min_bytes: int = PARALLEL_MIN_BYTES,
) -> BlockCopier | None:
    """A copier over `views`, or None when the extension is not built."""
    if _blockcopy is None:
        return None
    return BlockCopier.build(
        views, streaming_min_bytes=streaming_min_bytes, parallel_min_bytes=parallel_min_bytes
    )
