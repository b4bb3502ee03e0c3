"""Runs in every kvd process: the memory layout of a pool (SPEC section 3).

One row per block; a row holds `num_slots` slots (one per TP rank, or a single
shared slot for replicated MLA KV), each `slot_bytes` long and padded to a
`slot_stride` that is a multiple of `SLOT_ALIGN`:

    offset 0                                        row_bytes
    | slot 0 (rank 0) | pad | slot 1 (rank 1) | pad | ...   |   block 0
    | slot 0 (rank 0) | pad | slot 1 (rank 1) | pad | ...   |   block 1
    ...
    rank r's slot of block b = b * row_bytes + slot(r) * slot_stride,
    slot(r) = 0 when replicated, else r.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd_client.errors import BadRequest, TooLarge

SLOT_ALIGN = 256


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True, slots=True)
class Geometry:
    num_blocks: int
    row_bytes: int
    slot_bytes: int
    num_slots: int
    slot_stride: int
    replicated: bool

    @classmethod
    def plan(
        cls, *, slot_bytes: int, world_size: int, replicated: bool, capacity_bytes: int
    ) -> Geometry:
        """The layout of a pool of at most `capacity_bytes`; `TooLarge` if not one block fits."""
        if slot_bytes < 1:
            raise BadRequest(f"slot_bytes must be >= 1, got {slot_bytes}")
        if world_size < 1:
            raise BadRequest(f"world_size must be >= 1, got {world_size}")
        num_slots = 1 if replicated else world_size
        slot_stride = round_up(slot_bytes, SLOT_ALIGN)
        row_bytes = num_slots * slot_stride
        num_blocks = capacity_bytes // row_bytes
        if num_blocks < 1:
            raise TooLarge(
                f"capacity {capacity_bytes} bytes holds no block of {row_bytes} bytes "
                f"({num_slots} slot(s) of {slot_stride})"
            )
        return cls(num_blocks, row_bytes, slot_bytes, num_slots, slot_stride, replicated)

    @property
    def size_bytes(self) -> int:
        return self.num_blocks * self.row_bytes

    def slot_index(self, rank: int) -> int:
        return 0 if self.replicated else rank

    def slot_offset(self, block: int, rank: int) -> int:
        """Byte offset of `rank`'s slot of `block` in the segment."""
        return block * self.row_bytes + self.slot_index(rank) * self.slot_stride
