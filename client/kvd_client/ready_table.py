"""Runs in the daemon (writer) and in schedulers (readers): a pool's ready table, its layout.

The daemon publishes which keys of a pool are ready, and which are being
stored, in a shared-memory table that schedulers map read-only, so that a
lookup costs no message. One writer at a time (the daemon's event loop; a
warm restart's fill on a thread, under an odd epoch, before the loop writes
again), any number of readers, no locks: every bucket carries a sequence counter, odd while the
writer changes the bucket (the kernel's seqlock), and a reader that sees it
odd, or changed across its read, reads again, a bounded number of times,
then reports a miss. A hit is only ever a bucket read whole and unchanged,
so a reader never reports a key ready that was not ready at some moment of
its read.

    offset 0   header (64 bytes, little-endian)
               magic u64 "KVDREADY" | version u32 | bucket_bytes u32
               num_buckets u64 | generation u64 | epoch u64 | alive_ns u64 | reserved
    offset 64  bucket 0 | bucket 1 | ... | bucket num_buckets - 1
    bucket     seq u32 | state u8 | key_len u8 | reserved u16 | key (64 bytes)
               state: EMPTY 0, STORING 1, READY 2, GONE 3 (a deleted key: probes go on)

Keys go to bucket `crc32(key) & (num_buckets - 1)` (`bucket_of`; zlib's
CRC-32, which both Python and C have at hand), then linear probing; num_buckets is a power
of two at least twice the pool's blocks, so probes stay short. A reset bumps
`epoch` (odd while the buckets are being cleared, or a warm restart's
blocks written in); a reader whose lookup
straddles a change of epoch answers from the RPC path instead. The daemon
writes `alive_ns` (CLOCK_MONOTONIC, shared by every process of the host) at
least every half second; a table not written for `STALE_NS` belongs to a
daemon that died, and readers ask the daemon instead (it is down: 0 hits).
A dropped pool's table, and that of a daemon that shut down, is left with
an odd epoch.

x86-64 keeps stores in order and loads in order (TSO), which is what the
seqlock needs from Python's plain memory copies; other architectures would
need fences, and readers there fall back to the RPC path (`supported`).
"""

from __future__ import annotations

import importlib
import platform
import struct
import time
import zlib
from typing import Any

_native: Any
try:  # the probe loop in C, built with the package where a compiler was there
    _native = importlib.import_module("kvd_client._readytable")
except ImportError:  # pragma: no cover - depends on the install
    _native = None

MAGIC = int.from_bytes(b"KVDREADY", "little")
VERSION = 1
HEADER = struct.Struct("<QIIQQQ")  # magic, version, bucket_bytes, num_buckets, generation, epoch
HEADER_BYTES = 64
EPOCH_OFFSET = 32
ALIVE_OFFSET = 40
STALE_NS = 2_000_000_000  # a table its daemon has not written for this long is dead
BUCKET = struct.Struct("<IBBH")  # seq, state, key_len, reserved; the key follows
MAX_KEY_BYTES = 64
BUCKET_BYTES = BUCKET.size + MAX_KEY_BYTES  # 72
EMPTY, STORING, READY, GONE = 0, 1, 2, 3
READ_TRIES = 8  # a bucket changing under a reader this often: a miss


def supported() -> bool:
    """Whether this machine orders plain stores and loads as the seqlock needs."""
    return platform.machine().lower() in ("x86_64", "amd64")


def num_buckets_for(num_blocks: int) -> int:
    """A power of two, at least twice `num_blocks` (at most 2**31: CRC-32 bits)."""
    n = 1
    while n < 2 * num_blocks:
        n <<= 1
    return n


def table_bytes(num_blocks: int) -> int:
    return HEADER_BYTES + num_buckets_for(num_blocks) * BUCKET_BYTES


def bucket_of(key: bytes, mask: int) -> int:
    return zlib.crc32(key) & mask


def table_name(pool_segment: str) -> str:
    """The shared-memory name of the ready table of the pool segment `pool_segment`."""
    return pool_segment + ".ready"


class TableChanged(Exception):
    """The table was reset or rebuilt during a lookup: ask the daemon instead."""


class ReadyTable:
    """A reader's view of a mapped table (`buf`: a read-only mmap)."""

    def __init__(self, buf: memoryview | bytes | bytearray | object) -> None:
        self.buf = buf
        magic, version, bucket_bytes, num_buckets, generation, _ = HEADER.unpack_from(buf, 0)  # type: ignore[arg-type]
        if magic != MAGIC or version != VERSION or bucket_bytes != BUCKET_BYTES:
            raise ValueError(
                f"not a kvd ready table of version {VERSION} (magic {magic:#x}, "
                f"version {version}, bucket {bucket_bytes} bytes)"
            )
        if num_buckets < 1 or num_buckets & (num_buckets - 1):
            raise ValueError(f"ready table of {num_buckets} buckets: not a power of two")
        self.num_buckets = num_buckets
        self.generation = generation
        self._mask = num_buckets - 1
        self.native = _native is not None  # False: the Python reads below

    @property
    def path(self) -> str:
        """Which reader answers `lookup`: "c" or "python"."""
        return "c" if self.native else "python"

    def epoch(self) -> int:
        return int(struct.unpack_from("<Q", self.buf, EPOCH_OFFSET)[0])  # type: ignore[arg-type]

    def lookup(self, keys: list[bytes]) -> int | None:
        """`BlockIndex.lookup` on the published state: leading ready keys, `None`
        when the first key that is not ready is being stored. Raises
        `TableChanged` when a reset or rebuild overlapped the read."""
        if self.native:  # the same checks, the clock included, in C
            found = _native.lookup(self.buf, keys, READ_TRIES, STALE_NS)
            if found == -2:
                raise TableChanged("reset, dropped, or its daemon stopped writing it")
            return None if found == -1 else int(found)
        alive = struct.unpack_from("<Q", self.buf, ALIVE_OFFSET)[0]  # type: ignore[arg-type]
        if time.monotonic_ns() - alive > STALE_NS:
            raise TableChanged("the daemon stopped writing its table (it died?)")
        epoch = self.epoch()
        if epoch & 1:
            raise TableChanged("the table is being reset")
        hits = 0
        for key in keys:
            state = self.state(key)
            if state == READY:
                hits += 1
                continue
            if state == STORING:
                hits = -1
            break
        if self.epoch() != epoch:
            raise TableChanged("the table was reset during the lookup")
        return None if hits < 0 else hits

    def state(self, key: bytes) -> int:
        """READY, STORING, or EMPTY for a key absent (or a bucket that kept
        changing under the reader: a miss, never a wrong hit)."""
        buf, mask, n = self.buf, self._mask, len(key)
        i = bucket_of(key, mask)
        unpack, head = BUCKET.unpack_from, BUCKET.size
        for _ in range(self.num_buckets):
            off = HEADER_BYTES + i * BUCKET_BYTES
            for _try in range(READ_TRIES):
                seq, state, key_len, _ = unpack(buf, off)  # type: ignore[arg-type]
                if seq & 1:
                    continue
                same = key_len == n and buf[off + head : off + head + n] == key  # type: ignore[index]
                if unpack(buf, off)[0] == seq:  # type: ignore[arg-type]
                    break
            else:
                return EMPTY
            if state == EMPTY:
                return EMPTY
            if same and state != GONE:
                return int(state)
            i = (i + 1) & mask
        return EMPTY


class MappedTable(ReadyTable):
    """A ready table mapped read-only from shared memory (the scheduler's side)."""

    def __init__(self, name: str) -> None:
        import mmap

        import posix_ipc

        try:
            shm = posix_ipc.SharedMemory(name, read_only=True)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no ready table {name}") from None
        except posix_ipc.PermissionsError:
            raise PermissionError(f"ready table {name}: not readable by this user") from None
        try:
            size = shm.size
            if size < HEADER_BYTES:
                raise ValueError(f"ready table {name} is truncated ({size} bytes)")
            self._mm = mmap.mmap(shm.fd, size, prot=mmap.PROT_READ)
        finally:
            shm.close_fd()
        self.name = name
        super().__init__(self._mm)
        if size < HEADER_BYTES + self.num_buckets * BUCKET_BYTES:
            raise ValueError(f"ready table {name} is truncated ({size} bytes)")
