"""Runs in a TP worker (pure: no torch, no I/O): where one job's bytes go, as copy runs.

A transfer job pairs device blocks with pool blocks. This module checks the
pairs, merges consecutive ones into runs and says how wide an element every
copy may use; a backend turns the plan into tensor copies.

Host side: one row per pool block; this rank's slot sits `slot_offset` into
the row and holds the rank's page of every layer, in layer order:

    row p = p * row_bytes
    | ... | slot of this rank                              | ... |
          ^ row p + slot_offset
          | layer 0 page | layer 1 page | ... | layer L-1 page |
                         ^ + layer_offsets[1]

    host_offset(p, l) = p * row_bytes + slot_offset + layer_offsets[l]

Device side: per layer, one page per device block (the contiguous layout is
the case of one "layer" whose page is the whole slot).

A run `(device_start, pool_start, count)` is `count` pairs that advance by one
on both sides. Per layer it is ONE strided copy between two 2-D views:

    host:   [count, page_bytes[l]], rows row_bytes apart
    device: [count, page_bytes[l]], rows one device block apart

which is a single flat copy when both strides equal the page (one slot per
row, one layer): adjacent blocks then cost one large memcpy, not `count`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import index, sub

from kvd_client.errors import BadRequest
from kvd_client.geometry import Geometry
from kvd_client.types import JOB_KINDS, JobKind

# Widest first: a copy moves elements of the widest size that divides every
# offset, size and stride involved, so no copy ever works byte by byte.
ELEMENT_SIZES = (8, 4, 2, 1)


def widest_element(*values: int) -> int:
    """The widest of 8, 4, 2, 1 bytes that divides every value (any size divides 0)."""
    for size in ELEMENT_SIZES:
        if all(v % size == 0 for v in values):
            return size
    return 1


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Where one rank's pages live in the pool, in bytes.

    `page_bytes` has one entry per layer (a single entry for the contiguous
    layout); their sum is the slot size.
    """

    slot_offset: int
    row_bytes: int
    page_bytes: tuple[int, ...]
    num_pool_blocks: int
    layer_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.page_bytes or any(b < 1 for b in self.page_bytes):
            raise BadRequest(f"page sizes must be >= 1 byte, got {list(self.page_bytes)}")
        if self.slot_offset < 0 or self.slot_offset + self.slot_bytes > self.row_bytes:
            raise BadRequest(
                f"a slot of {self.slot_bytes} bytes at offset {self.slot_offset} "
                f"does not fit a row of {self.row_bytes} bytes"
            )
        offsets = (0, *accumulate(self.page_bytes))[:-1]
        object.__setattr__(self, "layer_offsets", offsets)

    @classmethod
    def of(
        cls,
        geometry: Geometry,
        rank: int,
        page_bytes: Sequence[int],
        *,
        part: int = 0,
        parts: int = 1,
    ) -> SlotLayout:
        """Rank `rank`'s slot in `geometry`; `BadRequest` unless the pages fill the slot.

        A slot may hold `parts` device blocks (vLLM's offload chunk), each block's
        pages of every layer back to back, block after block; the layout is then
        that of block `part` of each slot, and the pages fill one part.
        """
        if rank < 0 or (not geometry.replicated and rank >= geometry.num_slots):
            raise BadRequest(f"rank {rank} has no slot in a pool of {geometry.num_slots} slot(s)")
        if not 0 <= part < parts:
            raise BadRequest(f"part {part} of a slot of {parts} part(s)")
        pages = tuple(page_bytes)
        if sum(pages) * parts != geometry.slot_bytes:
            raise BadRequest(
                f"the KV pages of rank {rank} ({len(pages)} layer(s), {sum(pages)} bytes"
                f"{f', {parts} blocks a slot' if parts > 1 else ''}) "
                f"do not match the pool's slot_bytes {geometry.slot_bytes}"
            )
        return cls(
            geometry.slot_index(rank) * geometry.slot_stride + part * sum(pages),
            geometry.row_bytes,
            pages,
            geometry.num_blocks,
        )

    @property
    def slot_bytes(self) -> int:
        return sum(self.page_bytes)

    @property
    def num_layers(self) -> int:
        return len(self.page_bytes)

    def host_offset(self, pool_block: int, layer: int = 0) -> int:
        """Byte offset of `layer`'s page of `pool_block` in the region."""
        return pool_block * self.row_bytes + self.slot_offset + self.layer_offsets[layer]

    def alignment_values(self) -> tuple[int, ...]:
        """Every host offset, size and stride a copy uses, for `widest_element`."""
        return (self.slot_offset, self.row_bytes, *self.page_bytes, *self.layer_offsets)


@dataclass(frozen=True, slots=True)
class Run:
    """`count` pairs: device blocks `device_start..`, pool blocks `pool_start..`."""

    device_start: int
    pool_start: int
    count: int


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """The checked pairs of one job and where its runs start, in job order.

    Runs are kept as start indexes into the id lists rather than as objects:
    a job of many scattered small blocks is planned at tens of nanoseconds
    per block, well under the time its bytes take to copy.
    """

    kind: JobKind
    device_ids: Sequence[int]
    pool_ids: Sequence[int]
    run_starts: Sequence[int]

    @property
    def num_blocks(self) -> int:
        return len(self.device_ids)

    def run_counts(self) -> list[int]:
        return list(map(sub, [*self.run_starts[1:], self.num_blocks], self.run_starts))

    def split(self, min_count: int) -> tuple[list[Run], Sequence[int], Sequence[int]]:
        """Runs of at least `min_count` pairs, and the pairs of the shorter runs.

        Long runs are worth one copy each; the short ones are better moved by
        one indexed copy over all of them (device ids, pool ids, in job order).
        """
        d, p = self.device_ids, self.pool_ids
        if len(self.run_starts) == len(d) and min_count > 1:
            return [], d, p  # every pair alone: the common scattered case, no loop
        counts = self.run_counts()
        if not counts or max(counts) < min_count:
            return [], d, p
        long_runs: list[Run] = []
        device_ids: list[int] = []
        pool_ids: list[int] = []
        for a, c in zip(self.run_starts, counts, strict=True):
            if c >= min_count:
                long_runs.append(Run(d[a], p[a], c))
            else:
                device_ids.extend(d[a : a + c])
                pool_ids.extend(p[a : a + c])
        return long_runs, device_ids, pool_ids


def run_starts(device_ids: Sequence[int], pool_ids: Sequence[int]) -> list[int]:
    """Indexes where a run begins: pair i continues a run when both ids advance by one."""
    n = len(device_ids)
    if n == 0:
        return []
    d0, p0 = device_ids[0], pool_ids[0]
    # The common case costs no Python loop: both sides one ascending range.
    if (
        device_ids[-1] - d0 == n - 1
        and pool_ids[-1] - p0 == n - 1
        and list(device_ids) == list(range(d0, d0 + n))
        and list(pool_ids) == list(range(p0, p0 + n))
    ):
        return [0]
    starts = [0]
    prev_d, prev_p = d0, p0
    for i in range(1, n):
        d, p = device_ids[i], pool_ids[i]
        if d != prev_d + 1 or p != prev_p + 1:
            starts.append(i)
        prev_d, prev_p = d, p
    return starts


def check_job(
    kind: str,
    device_ids: Sequence[int],
    pool_ids: Sequence[int],
    num_device_blocks: int,
    num_pool_blocks: int,
) -> None:
    """`BadRequest` unless the job can be copied as asked; checks before any copy.

    Ids must lie in `[0, num_device_blocks)` and `[0, num_pool_blocks)`, both
    lists must be equally long, and no block may be written twice (the pool
    ids of a store, the device ids of a load): with distinct destinations the
    pairs are independent, so a backend may copy them in any order.
    """
    if kind not in JOB_KINDS:
        raise BadRequest(f"job kind must be 'store' or 'load', got {kind!r}")
    n = len(device_ids)
    if len(pool_ids) != n:
        raise BadRequest(f"{n} device block ids but {len(pool_ids)} pool block ids")
    if n == 0:
        return
    # min/max/set run in C: checking costs a fraction of copying.
    if min(device_ids) < 0 or max(device_ids) >= num_device_blocks:
        bad = next(d for d in device_ids if not 0 <= d < num_device_blocks)
        raise BadRequest(f"device block id {bad} is outside [0, {num_device_blocks})")
    if min(pool_ids) < 0 or max(pool_ids) >= num_pool_blocks:
        bad = next(p for p in pool_ids if not 0 <= p < num_pool_blocks)
        raise BadRequest(f"pool block id {bad} is outside [0, {num_pool_blocks})")
    written, side = (pool_ids, "pool") if kind == "store" else (device_ids, "device")
    if not isinstance(written, (list, tuple, range)) or type(written[0]) is not int:
        # Ids that hash by identity (0-d tensors) must not pass as all different.
        written = [index(block) for block in written]
    if len(set(written)) != n:
        seen: set[int] = set()
        for block in written:
            if block in seen:
                raise BadRequest(f"{kind} writes {side} block {block} twice")
            seen.add(block)


def plan_copy(
    kind: str,
    device_ids: Sequence[int],
    pool_ids: Sequence[int],
    num_device_blocks: int,
    num_pool_blocks: int,
) -> CopyPlan:
    """The checked, coalesced plan of one job; `BadRequest` as `check_job` says."""
    check_job(kind, device_ids, pool_ids, num_device_blocks, num_pool_blocks)
    checked: JobKind = "store" if kind == "store" else "load"
    return CopyPlan(checked, device_ids, pool_ids, run_starts(device_ids, pool_ids))
