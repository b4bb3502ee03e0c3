"""Runs in the operator's shell: how much of a daemon's `max_total_bytes` a suite's pools take.

A pool holds more shared memory than its rows (`capacity_bytes`): its
segment starts with a header and a slot table of one entry a block
(`kvd_client.segment.SegmentHeader`, SPEC 13), and its ready table (SPEC 15)
is a second segment of at least two buckets a block. The daemon counts all
of it against `max_total_bytes` and refuses a pool that does not fit
(`TOO_LARGE ... with its slot table`), so a suite that sizes its private
daemon asks `pool_footprint` for each pool it will hold at once and sums
them with `max_total_bytes`.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvd_client.geometry import Geometry, round_up
from kvd_client.protocol import Layout
from kvd_client.ready_table import table_bytes
from kvd_client.segment import ENTRY_BYTES, MAX_HEADER_BYTES, PAGE, SegmentHeader

# Room on top of the pools' exact sum, for a small pool a tool attaches on
# the side (a probe) or a few bytes more of a later segment format.
SLACK_BYTES = 1 << 20


def pool_footprint(pool: str, layout: Layout, capacity_bytes: int) -> int:
    """Bytes of `max_total_bytes` that pool `pool` takes when attached with
    `capacity_bytes` of rows: its whole segment (header, slot table, rows) and
    its ready table, computed as the daemon computes them."""
    g = Geometry.plan(
        slot_bytes=layout.slot_bytes,
        world_size=layout.world_size,
        replicated=layout.replicated,
        capacity_bytes=capacity_bytes,
    )
    header = SegmentHeader(
        0, g.num_blocks, g.row_bytes, g.slot_bytes, g.num_slots, g.slot_stride,
        g.replicated, pool, msgspec.msgpack.encode(layout), "adaptive",
    )  # fmt: skip
    return header.size_bytes + table_bytes(g.num_blocks)


def max_total_bytes(footprints: Iterable[int]) -> str:
    """The `--max-total-bytes` flag of a daemon holding pools of these footprints at once."""
    return str(sum(footprints) + SLACK_BYTES)


def footprint_bound(capacity_bytes: int, row_bytes: int) -> int:
    """At least `pool_footprint` of any pool of `capacity_bytes` whose rows are
    `row_bytes` or longer, for a pool whose layout an engine makes (vLLM's
    connector): the longest header, a slot-table entry and ready-table
    buckets for each of the most blocks that fit."""
    num_blocks = max(1, capacity_bytes // row_bytes)
    table = round_up(round_up(MAX_HEADER_BYTES, 64) + num_blocks * ENTRY_BYTES, PAGE)
    return table + capacity_bytes + table_bytes(num_blocks)
