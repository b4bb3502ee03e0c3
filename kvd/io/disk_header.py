"""Runs in the daemon: the header of a disk-tier slab, made and checked (SPEC 16).

The layout is pictured in `kvd.io.disk_slab`: a 4 KiB page at the start of
`<pool>.slab` whose `crc` is zlib's crc32 of the header with that field
zeroed; a start adopts a slab only if every field checks out.
"""

from __future__ import annotations

import struct
import zlib

from kvd_client.segment import BadSegment

MAGIC = b"KVDSLAB\0"
FORMAT_VERSION = 1
SLAB_HEADER = struct.Struct("<8sIIQQQQQ32s")
CRC_OFFSET = 12
ALIGN = 4096  # rows, offsets and buffers for O_DIRECT


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def slab_header(
    slab_id: int, num_blocks: int, row_bytes: int, disk_row_bytes: int, print_: bytes
) -> bytes:
    raw = bytearray(SLAB_HEADER.pack(MAGIC, FORMAT_VERSION, 0, slab_id, num_blocks, row_bytes,
                                     disk_row_bytes, ALIGN, print_))  # fmt: skip
    struct.pack_into("<I", raw, CRC_OFFSET, zlib.crc32(raw))
    return bytes(raw)


def check_slab_header(raw: bytes) -> tuple[int, int, int, int, bytes]:
    """(slab_id, num_blocks, row_bytes, disk_row_bytes, fingerprint); BadSegment if bad."""
    if len(raw) < SLAB_HEADER.size:
        raise BadSegment("slab shorter than its header")
    magic, version, crc, slab_id, n, row, disk_row, rows_offset, print_ = SLAB_HEADER.unpack(
        raw[: SLAB_HEADER.size]
    )
    if magic != MAGIC:
        raise BadSegment("no kvd slab header (bad magic)")
    if version != FORMAT_VERSION:
        raise BadSegment(f"slab format version {version}, this daemon reads {FORMAT_VERSION}")
    zeroed = bytearray(raw[: SLAB_HEADER.size])
    struct.pack_into("<I", zeroed, CRC_OFFSET, 0)
    if zlib.crc32(zeroed) != crc:
        raise BadSegment("slab header checksum mismatch")
    if rows_offset != ALIGN or disk_row != round_up(row) or n < 1:
        raise BadSegment("slab header geometry is inconsistent")
    return slab_id, n, row, disk_row, print_
