"""Runs in the daemon: the remote tier's keys and values (SPEC section 14).

A block in the remote store is one string value under one key:

    key    b"<prefix>:<fingerprint>:<block hash, hex>"
    value  header (VALUE_HEADER, little-endian), the block hash, the row

    header:  0 magic 4s "KVDB"   4 version u16   6 key_len u16
             8 row_len u64      16 crc u32 (CRC-32C of header bytes 0..15,
                                            then the block hash, then the row)

The fingerprint (`layout_fingerprint`) is a digest of the pool's layout and
of the row geometry that follows from it, so two pools see each other's
blocks exactly when an engine could load one's rows into the other: same
model, dtype, block size, TP size, replication, slot bytes and engine
fingerprint (the pool's name does not count). `decode_value` checks every
field: a value that is short, long, of another version, of another key or
with a wrong checksum is refused (`BadValue`) and the caller counts a miss;
its bytes never reach a slot. The checksum is CRC-32C, in C where the
package was built with its extension (`kvd_client._crc32c`; tens of GB/s
less than a remote GET needs), else in Python, slowly.
"""

from __future__ import annotations

import hashlib
import importlib
import struct
from collections.abc import Callable
from typing import Any

import msgspec

from kvd_client.geometry import Geometry
from kvd_client.protocol import Layout

MAGIC = b"KVDB"
FORMAT_VERSION = 1
VALUE_HEADER = struct.Struct("<4sHHQI")  # magic, version, key_len, row_len, crc
HEADER_BYTES = VALUE_HEADER.size  # 20
_CRC_COVERS = 16  # the header bytes before the crc field

_POLY = 0x82F63B78
_TABLE = []
for _n in range(256):
    _c = _n
    for _ in range(8):
        _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
    _TABLE.append(_c)


def crc32c_python(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C, one byte at a time: the reference, and the fallback without C."""
    table = _TABLE
    c = crc ^ 0xFFFFFFFF
    for byte in bytes(data):
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


_native: Any
try:
    _native = importlib.import_module("kvd_client._crc32c")
except ImportError:  # pragma: no cover - depends on the install
    _native = None

crc32c: Callable[..., int] = _native.crc32c if _native is not None else crc32c_python
NATIVE_CRC = _native is not None


class BadValue(Exception):
    """A remote value that is not the block asked for; the message says why."""


_layout_encoder = msgspec.msgpack.Encoder()


def layout_fingerprint(layout: Layout, geometry: Geometry) -> str:
    """The part of a remote key that names what a row holds (hex, 32 chars)."""
    g = geometry
    shape = struct.pack("<QQII?", g.row_bytes, g.slot_bytes, g.num_slots, g.slot_stride,
                        g.replicated)  # fmt: skip
    digest = hashlib.sha256(_layout_encoder.encode(layout) + shape).hexdigest()
    return digest[:32]


def remote_key(prefix: str, fingerprint: str, key: bytes) -> bytes:
    return f"{prefix}:{fingerprint}:{key.hex()}".encode()


def encode_header(key: bytes, row: bytes | bytearray | memoryview) -> bytes:
    """The header and block hash that go before `row` in its remote value."""
    head = struct.pack("<4sHHQ", MAGIC, FORMAT_VERSION, len(key), len(row))
    crc = crc32c(row, crc32c(key, crc32c(head)))
    return head + struct.pack("<I", crc) + key


def encode_value(key: bytes, row: bytes | bytearray | memoryview) -> bytearray:
    """A whole value: header, block hash, row (one buffer, for one SET)."""
    head = encode_header(key, row)
    value = bytearray(len(head) + len(row))
    value[: len(head)] = head
    value[len(head) :] = row
    return value


def _open(value: bytes, key: bytes, row_bytes: int) -> tuple[memoryview, int, int]:
    """Checks all but the checksum: the row, the CRC of what comes before it, the
    CRC the header says."""
    if len(value) < HEADER_BYTES:
        raise BadValue(f"{len(value)} bytes: shorter than a header")
    magic, version, key_len, row_len, crc = VALUE_HEADER.unpack_from(value)
    if magic != MAGIC:
        raise BadValue(f"magic {magic!r} is not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise BadValue(f"format version {version}; this daemon reads {FORMAT_VERSION}")
    if row_len != row_bytes:
        raise BadValue(f"row of {row_len} bytes; this pool's rows are {row_bytes}")
    start = HEADER_BYTES + key_len
    if len(value) != start + row_len:
        raise BadValue(f"{len(value)} bytes; header and row make {start + row_len}")
    view = memoryview(value)
    if bytes(view[HEADER_BYTES:start]) != key:
        raise BadValue("the value holds another block")
    return view[start:], crc32c(key, crc32c(view[:_CRC_COVERS])), crc


def decode_value(value: bytes, key: bytes, row_bytes: int) -> memoryview:
    """The row inside `value`, after checking it is block `key` of `row_bytes` bytes."""
    row, head_crc, crc = _open(value, key, row_bytes)
    if crc32c(row, head_crc) != crc:
        raise BadValue("checksum mismatch")
    return row


def copy_value(dst: memoryview, value: bytes, key: bytes, row_bytes: int) -> None:
    """Copies the row of `value` into `dst` (its slot) and checks it on the way,
    in one pass: `BadValue` if it is not block `key`, in which case `dst` holds
    bytes no one may read (the caller frees the slot; it never becomes ready)."""
    row, head_crc, crc = _open(value, key, row_bytes)
    if _native is not None:
        got = _native.copy_crc32c(dst, row, head_crc)
    else:
        got = crc32c(row, head_crc)
        dst[:] = row
    if got != crc:
        raise BadValue("checksum mismatch")
