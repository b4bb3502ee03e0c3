"""Runs in every kvd process: the layout of a pool's segment, its header and slot table (SPEC 13).

A pool's segment (`/dev/shm/kvd.<pool>.<generation>`) describes itself, so
that a restarted daemon can adopt it and a worker can map it by name:

    offset 0                  table_offset            data_offset (page aligned)
    | header               | pad | slot table        | pad | rows (SPEC 3)       |
    | magic, version, crc, |     | num_blocks entries |     | block 0, block 1 ...|
    | geometry, generation,|     | of ENTRY_BYTES     |     |                     |
    | name, layout, policy |     |                    |     |                     |

    header (little-endian, HEADER_FIXED bytes, then the pool name and the
    layout as msgpack; `crc` is zlib's crc32 of the whole header with the
    crc field zeroed):
      0 magic 8s "KVDPOOL\\0"     8 version u32       12 crc u32
     16 generation u64           24 num_blocks u64   32 row_bytes u64
     40 slot_bytes u64           48 num_slots u32    52 slot_stride u32
     56 replicated u8 (7 pad)    64 table_offset u64 72 data_offset u64
     80 entry_bytes u32          84 name_len u16     86 layout_len u16
     88 policy 16s               104 fingerprint 32s (sha256 of the layout bytes)

    slot table entry of block b at table_offset + b * ENTRY_BYTES:
      0 state u8 (FREE 0, READY 1, STORING 2)   1 key_len u8
      2 pinned u8 (1 while a load may read a READY block)   3 pad u8
      4 crc u32 (crc32 of key_len, seq, key)   8 seq u64   16 key 64s

Rank r's slot of block b is at `data_offset + b * row_bytes + slot(r) *
slot_stride`: workers map the rows from `data_offset` on, so every offset
of SPEC 3 holds within their mapping unchanged.

The daemon alone writes the header and the table. A slot's state byte is
set to STORING before the slot is handed to a store (before any rank is
sent the job: one write, which also takes a READY victim out of the ready
set); the entry is written whole while its state is FREE, and only then its
state byte set to READY, once every rank has acknowledged the block's
store; a store that failed sets FREE only once no rank can copy it any more
(the job settled). A READY block's `pinned` byte is 1 from its first load
pin to its last release, so while a load job may still read it. Each write
is a store in program order into shared memory that outlives the process,
so a daemon killed at any instant leaves every entry FREE, STORING (a job
of the dead daemon may still write the slot), or READY over a whole entry
whose block's bytes were all acknowledged: a restart that adopts READY
entries whose crc matches never serves a block that was being stored, and
it holds back the STORING slots and keeps the pinned blocks (neither handed
to a store) until the dead daemon's jobs' deadlines passed. A Reset that
waits for the pool's copies turns every READY entry FREE before it is
acknowledged, a pinned one STORING first (held like a store in flight),
and writes no READY entry until the pool is empty: a restart never brings
back a block of an acknowledged Reset.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVDPOOL\0"
FORMAT_VERSION = 2  # 2: STORING and `pinned` (a version-1 table names neither)
HEADER = struct.Struct("<8sIIQQQQIIB7xQQIHH16s32s")
HEADER_FIXED = HEADER.size  # 136
MAX_HEADER_BYTES = HEADER_FIXED + 2 * 0xFFFF  # the fixed part, the longest name and layout
CRC_OFFSET = 12
ENTRY = struct.Struct("<BBBxIQ64s")
ENTRY_BYTES = ENTRY.size  # 80
ENTRY_BODY = struct.Struct("<BQ64s")  # what an entry's crc covers: key_len, seq, key
FREE, READY, STORING = 0, 1, 2
PINNED_AT = 2  # the offset of an entry's `pinned` byte
MAX_KEY_BYTES = 64
PAGE = mmap.PAGESIZE


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def fingerprint(layout_bytes: bytes) -> bytes:
    return hashlib.sha256(layout_bytes).digest()


def entry_crc(key: bytes, seq: int) -> int:
    return zlib.crc32(ENTRY_BODY.pack(len(key), seq, key))


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """What a segment says about itself."""

    generation: int
    num_blocks: int
    row_bytes: int
    slot_bytes: int
    num_slots: int
    slot_stride: int
    replicated: bool
    name: str  # the pool's name
    layout: bytes  # the pool's `Layout`, msgpack-encoded (kvd_client.protocol)
    policy: str
    version: int = FORMAT_VERSION

    @property
    def table_offset(self) -> int:
        return _round_up(HEADER_FIXED + len(self.name.encode()) + len(self.layout), 64)

    @property
    def data_offset(self) -> int:
        return _round_up(self.table_offset + self.num_blocks * ENTRY_BYTES, PAGE)

    @property
    def size_bytes(self) -> int:
        """The whole segment: header, table and rows."""
        return self.data_offset + self.num_blocks * self.row_bytes

    def pack(self) -> bytes:
        name = self.name.encode()
        if len(name) > 0xFFFF or len(self.layout) > 0xFFFF:
            raise ValueError("pool name or layout too long for a segment header")
        fixed = HEADER.pack(
            MAGIC, self.version, 0, self.generation, self.num_blocks, self.row_bytes,
            self.slot_bytes, self.num_slots, self.slot_stride, int(self.replicated),
            self.table_offset, self.data_offset, ENTRY_BYTES, len(name), len(self.layout),
            self.policy.encode()[:16], fingerprint(self.layout),
        )  # fmt: skip
        raw = bytearray(fixed + name + self.layout)
        struct.pack_into("<I", raw, CRC_OFFSET, zlib.crc32(raw))
        return bytes(raw)


class BadSegment(ValueError):
    """A segment that is not a pool of this format: the reason, for one log line."""


def read_header(buf: bytes | memoryview | mmap.mmap, size: int) -> SegmentHeader:
    """The header at the start of `buf` (a segment of `size` bytes); `BadSegment` if
    its magic, version, checksum, fields or size are wrong."""
    if size < HEADER_FIXED:
        raise BadSegment(f"{size} bytes, shorter than a header")
    fixed = bytes(buf[:HEADER_FIXED])
    (magic, version, crc, generation, num_blocks, row_bytes, slot_bytes, num_slots,
     slot_stride, replicated, table_offset, data_offset, entry_bytes, name_len, layout_len,
     policy, print_) = HEADER.unpack(fixed)  # fmt: skip
    if magic != MAGIC:
        raise BadSegment("no kvd pool header (bad magic)")
    if version != FORMAT_VERSION:
        raise BadSegment(f"format version {version}, this daemon reads {FORMAT_VERSION}")
    end = HEADER_FIXED + name_len + layout_len
    if end > size:
        raise BadSegment("header runs past the segment (truncated)")
    raw = bytearray(buf[:end])
    struct.pack_into("<I", raw, CRC_OFFSET, 0)
    if zlib.crc32(raw) != crc:
        raise BadSegment("header checksum mismatch")
    name = bytes(raw[HEADER_FIXED : HEADER_FIXED + name_len])
    layout = bytes(raw[HEADER_FIXED + name_len : end])
    if fingerprint(layout) != print_:
        raise BadSegment("layout fingerprint mismatch")
    header = SegmentHeader(
        generation, num_blocks, row_bytes, slot_bytes, num_slots, slot_stride,
        bool(replicated), name.decode(errors="replace"), layout,
        policy.rstrip(b"\0").decode(errors="replace"), version,
    )  # fmt: skip
    if entry_bytes != ENTRY_BYTES or (table_offset, data_offset) != (
        header.table_offset,
        header.data_offset,
    ):
        raise BadSegment("header offsets do not match its geometry")
    if num_blocks < 1 or row_bytes < 1 or num_slots * slot_stride != row_bytes:
        raise BadSegment("header geometry is inconsistent")
    if size != header.size_bytes:
        raise BadSegment(f"{size} bytes, the header says {header.size_bytes}")
    return header


def read_segment_header(fd: int) -> SegmentHeader:
    """The header of the open segment `fd` (see `read_header`)."""
    size = os.fstat(fd).st_size
    return read_header(os.pread(fd, min(size, MAX_HEADER_BYTES), 0), size)
