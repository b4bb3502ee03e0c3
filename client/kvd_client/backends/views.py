"""Runs in a TP worker: views of the device pages and the pool slots, and the copies over them.

Built once per backend (`BlockViews`): typed views of every layer's pages on
the device and of this rank's slots in the mapped region, in the widest
integer element that divides every offset and stride
(`copy_plan.widest_element`), so no copy ever moves single bytes.

The copy primitives, and why (torch on x86, measured in `kvd bench transfer`):

- `index_select(src, 0, idx, out=dst)` with rows under 32768 elements (torch's
  GRAIN_SIZE) is a parallel loop of one `memcpy` per row, even when the rows
  of `dst` are strided: a gather into consecutive rows runs at memcpy speed.
  `gather_rows` reads its source as overlapping rows (row i starts at element
  i), so any page is addressed by its element offset, and cuts pages longer
  than `MAX_ROW_ELEMS` into parts, each its own memcpy (above the limit torch
  runs one parallel copy per row instead, a fork and join per page).
- `index_copy_` (a scatter) walks element by element; with int64 elements it
  reaches about 70 % of memcpy, with 16-byte complex128 elements (bits only
  moved, never computed on) about 95 % on pages of 8 KiB and up:
  `wide_index_copy`.
- `LayerSpan`: per-layer caches are separate allocations, so one view over
  the address range of them all lets a single call fill or drain whole slots
  in pool order instead of one call per layer:

      span (all layer tensors):  |L0 pages ...|   |L1 pages ...|   ...
      host slot p:   [L0 page of d][L1 page of d] ...  <-> offsets of d in L0, L1, ...
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvd_client.backends.base import CopyJob
from kvd_client.copy_plan import CopyPlan, SlotLayout, check_job, plan_copy, widest_element
from kvd_client.errors import BadRequest
from kvd_client.geometry import Geometry

if TYPE_CHECKING:
    from typing_extensions import Buffer

KvCaches = torch.Tensor | Sequence[torch.Tensor]

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Longest row `gather_rows` hands to index_select in one piece; torch's memcpy
# path ends at 32768 elements.
MAX_ROW_ELEMS = 16384
# A span over the layer tensors is only a view, but keep it sane.
MAX_SPAN_BYTES = 1 << 42


def device_layers(kv_caches: KvCaches) -> list[torch.Tensor]:
    """`kv_caches` as a list of layers; `BadRequest` unless each is `[num_blocks, ...]` alike."""
    layers = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
    if not layers:
        raise BadRequest("kv_caches holds no tensor")
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise BadRequest(f"kv_caches[{i}] is not a tensor [num_blocks, ...]")
        if t.shape[0] != layers[0].shape[0] or t.device != layers[0].device:
            raise BadRequest(
                f"kv_caches[{i}] has {t.shape[0]} blocks on {t.device}, "
                f"kv_caches[0] {layers[0].shape[0]} on {layers[0].device}"
            )
        if t.shape[0] < 1 or t[0].numel() < 1:
            raise BadRequest(f"kv_caches[{i}] has no blocks or empty pages")
        if not t[0].is_contiguous() or t.stride(0) * t.element_size() < t[0].nbytes:
            raise BadRequest(f"kv_caches[{i}]: each block's page must be contiguous and apart")
    return layers


def typed_view(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset_bytes: int,
    size: Sequence[int],
    stride_bytes: Sequence[int],
) -> torch.Tensor:
    """A view of `storage` as `dtype`: `size` in elements, strides and offset in bytes.

    Every byte count must be a multiple of the dtype's size (`widest_element`
    chose it so).
    """
    item = dtype.itemsize
    view = torch.empty(0, dtype=dtype, device=storage.device)
    return view.set_(storage, offset_bytes // item, tuple(size), [s // item for s in stride_bytes])


def overlapping_rows(flat: torch.Tensor, width: int) -> torch.Tensor:
    """`flat` read as rows of `width` elements, row i starting at element i.

    Only a source: rows overlap, so gathering row `offset` reads the `width`
    elements at `offset`.
    """
    return flat.as_strided((flat.numel() - width + 1, width), (1, 1))


def row_parts(width: int) -> int:
    """Into how many equal parts a row of `width` elements is cut to stay on the fast path."""
    parts = -(-width // MAX_ROW_ELEMS)
    while width % parts:
        parts += 1
    return parts


def gather_rows(flat: torch.Tensor, offsets: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst[i] = flat[offsets[i] : offsets[i] + width]` for every row i of `dst`.

    `dst` is `[m, width]` with contiguous rows (any row stride); `offsets` are
    element offsets into the 1-D `flat`.
    """
    m, width = dst.shape
    parts = row_parts(width) if dst.is_contiguous() else 1
    if parts > 1:
        # Rows back to back: cut each into parts, each its own memcpy.
        width //= parts
        steps = torch.arange(0, parts * width, width, dtype=torch.int64)
        offsets = (offsets[:, None] + steps).flatten()
        dst = dst.view(m * parts, width)
    torch.index_select(overlapping_rows(flat, width), 0, offsets, out=dst)


def gather_pages(
    pages: torch.Tensor, flat: torch.Tensor, index: torch.Tensor, dst: torch.Tensor
) -> None:
    """`dst[i] = pages[index[i]]` for every row i of `dst`.

    `pages` is `[n, width]` with contiguous rows and `flat` a 1-D view of the
    same storage that covers it; `flat` serves when rows must be cut in parts.
    """
    if dst.shape[1] <= MAX_ROW_ELEMS or not dst.is_contiguous():
        torch.index_select(pages, 0, index, out=dst)
        return
    first = int(pages.storage_offset()) - int(flat.storage_offset())
    gather_rows(flat, index * pages.stride(0) + first, dst)


def wide_index_copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.index_copy_(0, index, src)`, moving 16-byte elements where both allow it.

    `index_copy_` walks element by element; complex128 elements (bits moved,
    never computed on) halve the walk of an int64 view.
    """
    if dst.dtype == torch.int64 and _pairs_of_int64(dst) and _pairs_of_int64(src):
        dst, src = dst.view(torch.complex128), src.view(torch.complex128)
    dst.index_copy_(0, index, src)


def _pairs_of_int64(t: torch.Tensor) -> bool:
    return (
        t.shape[-1] % 2 == 0
        and t.stride(-1) == 1
        and t.stride(0) % 2 == 0
        and int(t.storage_offset()) % 2 == 0
        and t.untyped_storage().data_ptr() % 16 == 0
    )


def id_tensor(ids: Sequence[int]) -> torch.Tensor:
    # array('q') converts a list several times faster than torch.tensor does.
    return torch.frombuffer(array.array("q", ids), dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class BlockViews:
    """Views of the device pages and of this rank's slots, built once.

    device[l]:     [num_device_blocks, page_elems[l]]   rows one device block apart
    host[l]:       [num_pool_blocks, page_elems[l]]     rows row_bytes apart, at the
                                                        layer's offset in the slot
    slots:         [num_pool_blocks, slot_elems]        this rank's whole slots
    host_flat:     the region, [size_bytes / elem]
    device_flat[l]: layer l from its page 0 to its last page, flat
    """

    layout: SlotLayout
    dtype: torch.dtype
    device: list[torch.Tensor]
    host: list[torch.Tensor]
    slots: torch.Tensor
    host_flat: torch.Tensor
    device_flat: list[torch.Tensor]
    num_device_blocks: int
    # Where each layer's pages were when the views were built: copies that
    # keep raw addresses (`LayerSpan`, the native copier) must not outlive them.
    device_ptrs: tuple[int, ...]

    @classmethod
    def build(
        cls,
        kv_caches: KvCaches,
        region: Buffer,
        geometry: Geometry,
        rank: int,
        *,
        part: int = 0,
        parts: int = 1,
    ) -> BlockViews:
        """`part` of `parts`: views of that block of slots holding several
        (`SlotLayout.of`); the pool blocks are the slots."""
        layers = device_layers(kv_caches)
        pages = [t[0].nbytes for t in layers]
        layout = SlotLayout.of(geometry, rank, pages, part=part, parts=parts)
        try:
            if memoryview(region).readonly:
                raise BadRequest("the pool region is mapped read-only")
        except TypeError:
            raise BadRequest("the pool region does not support the buffer protocol") from None
        whole = torch.frombuffer(region, dtype=torch.uint8)
        if whole.numel() < geometry.size_bytes:
            raise BadRequest(
                f"the pool region has {whole.numel()} bytes, geometry needs {geometry.size_bytes}"
            )
        dev_values = []
        for t in layers:
            size = t.element_size()
            dev_values += [t.data_ptr(), t.stride(0) * size, int(t.storage_offset()) * size]
        elem = widest_element(*layout.alignment_values(), whole.data_ptr(), *dev_values)
        dtype = _DTYPES[elem]
        device, device_flat = [], []
        for t in layers:
            offset = int(t.storage_offset()) * t.element_size()
            stride = t.stride(0) * t.element_size()
            storage = t.untyped_storage()
            device.append(
                typed_view(storage, dtype, offset, (len(t), t[0].nbytes // elem), (stride, elem))
            )
            span = (len(t) - 1) * stride + t[0].nbytes
            device_flat.append(typed_view(storage, dtype, offset, (span // elem,), (elem,)))
        storage = whole.untyped_storage()
        nb, row = layout.num_pool_blocks, layout.row_bytes
        host = [
            typed_view(
                storage, dtype, layout.host_offset(0, layer), (nb, page // elem), (row, elem)
            )
            for layer, page in enumerate(layout.page_bytes)
        ]
        slots = typed_view(
            storage, dtype, layout.slot_offset, (nb, layout.slot_bytes // elem), (row, elem)
        )
        host_flat = typed_view(storage, dtype, 0, (geometry.size_bytes // elem,), (elem,))
        ptrs = tuple(d.data_ptr() for d in device)
        return cls(layout, dtype, device, host, slots, host_flat, device_flat, len(layers[0]), ptrs)

    def check_unmoved(self) -> None:
        """`BadRequest` if a KV cache tensor was re-allocated (resized) under the views."""
        if tuple(d.data_ptr() for d in self.device) != self.device_ptrs:
            raise BadRequest(
                "the KV cache tensors moved since the worker mapped them; "
                "close the Worker and build it again over the new tensors"
            )

    def plan(self, job: CopyJob) -> CopyPlan:
        """The job's checked plan; `BadRequest` for ids it cannot copy."""
        self.check_unmoved()
        return plan_copy(
            job.kind,
            job.device_block_ids,
            job.pool_block_ids,
            self.num_device_blocks,
            self.layout.num_pool_blocks,
        )

    def check(self, job: CopyJob) -> None:
        """`BadRequest` for ids this job cannot copy, as `plan` checks them."""
        self.check_unmoved()
        check_job(
            job.kind,
            job.device_block_ids,
            job.pool_block_ids,
            self.num_device_blocks,
            self.layout.num_pool_blocks,
        )

    def min_run(self, min_bytes: int) -> int:
        """The fewest blocks a run needs for each of its per-layer copies to reach `min_bytes`."""
        return max(1, -(-min_bytes // min(self.layout.page_bytes)))


@dataclass(frozen=True, slots=True)
class LayerSpan:
    """One flat view over every layer's pages, to move whole slots in one call.

    Only built when all pages are the same size and slots lie back to back in
    the region (one slot per row, no padding), so a run of slots is a run of
    `[num_layers * blocks, page]` rows. Its element is 16 bytes (complex128,
    only ever moved, never computed on) when every address allows: that
    halves the per-element work of `index_copy_`.
    """

    flat: torch.Tensor  # elements from the lowest layer's page 0 to the highest's end
    bases: torch.Tensor  # [num_layers]: element offset of each layer's page 0 in `flat`
    strides: torch.Tensor  # [num_layers]: elements from one device block to the next
    slot_pages: torch.Tensor  # the region's slots as rows of one page: [blocks * layers, page]

    @classmethod
    def build(cls, views: BlockViews) -> LayerSpan | None:
        layout = views.layout
        pages = set(layout.page_bytes)
        if layout.num_layers < 2 or len(pages) != 1 or layout.row_bytes != layout.slot_bytes:
            return None
        lo = min(f.data_ptr() for f in views.device_flat)
        hi = max(f.data_ptr() + f.nbytes for f in views.device_flat)
        if hi - lo > MAX_SPAN_BYTES:
            return None
        strides_bytes = [d.stride(0) * d.element_size() for d in views.device]
        ptrs = [f.data_ptr() for f in views.device_flat]
        host_ptr = views.host_flat.data_ptr()
        wide = all(v % 16 == 0 for v in (*ptrs, *strides_bytes, *layout.page_bytes, host_ptr))
        dtype = torch.complex128 if wide else views.dtype
        item = dtype.itemsize
        # A buffer over the address range of all layer tensors: a view, nothing
        # is copied or touched; copies reach only inside the layers' pages.
        memory = (ctypes.c_byte * (hi - lo)).from_address(lo)
        flat = torch.frombuffer(memory, dtype=dtype)
        bases = [(ptr - lo) // item for ptr in ptrs]
        strides = [stride // item for stride in strides_bytes]
        page = pages.pop() // item
        num_rows = layout.num_pool_blocks * layout.num_layers
        host = views.host_flat.view(torch.uint8).view(dtype)
        slot_pages = host.as_strided((num_rows, page), (page, 1), layout.slot_offset // item)
        return cls(flat, torch.tensor(bases), torch.tensor(strides), slot_pages)

    @property
    def num_layers(self) -> int:
        return self.bases.numel()

    def offsets(self, device_ids: torch.Tensor) -> torch.Tensor:
        """Element offsets of every layer's page of each block, block-major."""
        return (device_ids[:, None] * self.strides + self.bases).flatten()

    def store(self, first_pool: int, device_ids: torch.Tensor) -> None:
        """Slots `first_pool..` <- `device_ids`: one gather, slots written in order."""
        count, layers = device_ids.numel(), self.num_layers
        rows = self.slot_pages.narrow(0, first_pool * layers, count * layers)
        gather_rows(self.flat, self.offsets(device_ids), rows)

    def load(self, first_pool: int, device_ids: torch.Tensor) -> None:
        """`device_ids` <- slots `first_pool..`: one scatter, slots read in order."""
        count, layers = device_ids.numel(), self.num_layers
        rows = self.slot_pages.narrow(0, first_pool * layers, count * layers)
        self._scatter(device_ids, rows)

    def store_into(self, slots: torch.Tensor, device_ids: torch.Tensor) -> None:
        """`slots` (bytes, `[blocks, slot_bytes]`, contiguous) <- `device_ids`."""
        gather_rows(self.flat, self.offsets(device_ids), self._as_pages(slots))

    def load_from(self, slots: torch.Tensor, device_ids: torch.Tensor) -> None:
        """`device_ids` <- `slots` (bytes, `[blocks, slot_bytes]`, contiguous)."""
        self._scatter(device_ids, self._as_pages(slots))

    def _as_pages(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.view(self.flat.dtype).view(-1, self.slot_pages.shape[1])

    def _scatter(self, device_ids: torch.Tensor, rows: torch.Tensor) -> None:
        overlapping_rows(self.flat, rows.shape[1]).index_copy_(0, self.offsets(device_ids), rows)
