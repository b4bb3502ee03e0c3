"""Runs in the daemon: a pool's slab on disk and its entry table (SPEC 16).

Two files per pool in `disk_dir`, made when the pool first gets its disk
tier and adopted by every later start whose checks pass:

    <pool>.slab     header page, then num_blocks rows, each `disk_row_bytes`
                    (row_bytes rounded up to ALIGN) at rows_offset + i * that
    <pool>.entries  a segment's header and slot table (kvd_client.segment:
                    the same entry format, state, crc and seq as a pool's
                    segment, so the warm start's scan in C reads it), then
                    one u32 per row: CRC-32C of the key followed by the row

    slab header (little-endian, SLAB_HEADER; `crc` is zlib's crc32 of it with
    the crc field zeroed):
      0 magic 8s "KVDSLAB\\0"    8 version u32     12 crc u32
     16 slab_id u64 (the entry table's header carries it as its generation)
     24 num_blocks u64          32 row_bytes u64  40 disk_row_bytes u64
     48 rows_offset u64         56 fingerprint 32s (sha256 of the pool's layout)

Both files are given their whole size when made (`posix_fallocate`), so a
full filesystem shows then (`SlabError`), never mid-write. The slab is
locked (`flock`, exclusive) while open: two daemons never share one. Rows
move whole (`disk_row_bytes` from or into an aligned staging buffer) with
`O_DIRECT` where the filesystem takes it, else buffered with
`POSIX_FADV_DONTNEED` after each row (the page cache is not a second copy).

A row is written before its checksum and its entry, whose state is STORING
from the moment its slot is handed to a write (kvd_client.segment's order):
a daemon killed mid-write leaves no entry naming a half-written row, and
every read is checked against the row's CRC-32C. Row I/O goes through the
fault seam of `kvd.io.disk_faults` (tests only).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import struct
import threading
import time
from pathlib import Path

from kvd.io.disk_faults import Faults
from kvd.io.disk_header import (
    ALIGN,
    CRC_OFFSET,
    FORMAT_VERSION,
    SLAB_HEADER,
    check_slab_header,
    round_up,
    slab_header,
)
from kvd.io.slot_table import SlotTable
from kvd_client.segment import (
    HEADER,
    MAX_HEADER_BYTES,
    PAGE,
    BadSegment,
    SegmentHeader,
    read_header,
)

log = logging.getLogger("kvd.io.disk_slab")
__all__ = ["ALIGN", "CRC_OFFSET", "FORMAT_VERSION", "SLAB_HEADER", "Slab", "SlabError",
           "open_slab", "round_up", "slab_path"]  # fmt: skip

ROW_CRC = struct.Struct("<I")


class SlabError(OSError):
    """A slab that cannot be made or used (no space, locked by another daemon)."""


def _entries_size(header: SegmentHeader) -> int:
    return header.data_offset + round_up(ROW_CRC.size * header.num_blocks, PAGE)


def _reserve(fd: int, size: int, what: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise SlabError(
            exc.errno, f"cannot reserve {size} bytes for {what}: {exc.strerror}"
        ) from None


def _open_direct(path: Path) -> tuple[int, bool]:
    """The slab opened read-write, with O_DIRECT if the filesystem takes it."""
    try:
        return os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDWR | os.O_CLOEXEC), False


class Slab:
    """One pool's slab and entry table, open and locked. `table` is the disk
    index's slot sink; `crcs` the rows' checksums (u32 per slot). Every row
    moves whole (`disk_row_bytes`, at an aligned offset, from or into an
    aligned staging buffer), so O_DIRECT serves any row size."""

    def __init__(
        self,
        path: Path,
        fd: int,
        direct: bool,
        efd: int,
        table: SlotTable,
        crc_map: mmap.mmap,
        header: SegmentHeader,
        faults: Faults,
    ) -> None:
        self.path = path
        self.fd = fd  # the slab, locked (flock) for as long as it is open
        self.efd = efd  # the entry table, for fsync (its pages are mapped)
        self.header = header
        self.table = table
        self._crc_map = crc_map
        self.crcs = memoryview(crc_map).cast("I")
        self.row_bytes = header.row_bytes
        self.disk_row_bytes = round_up(header.row_bytes)
        self.num_blocks = header.num_blocks
        self.direct = direct
        self.faults = faults
        self.created = False  # made now, not adopted
        self.closed = False  # no new I/O; the files close once the last one ends
        self._users = 0
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        return ALIGN + self.num_blocks * self.disk_row_bytes + _entries_size(self.header)

    def offset(self, slot: int) -> int:
        return ALIGN + slot * self.disk_row_bytes

    def read_row(self, slot: int, buf: memoryview) -> int:
        """Reads row `slot` into `buf` (disk_row_bytes, aligned); the bytes read.
        Raises OSError (EIO...). Runs on an I/O thread, between `enter` and `leave`."""
        f = self.faults
        if f.read_slow_s:
            time.sleep(f.read_slow_s)
        if f.read_eio:
            raise OSError(errno.EIO, "injected read error (KVD_DISK_FAULTS)")
        at = self.offset(slot)
        n = os.preadv(self.fd, [buf[: self.disk_row_bytes]], at)
        if not self.direct:  # buffered (the filesystem refused O_DIRECT): not cached twice
            os.posix_fadvise(self.fd, at, n, os.POSIX_FADV_DONTNEED)
        return n // 2 if f.read_short else n

    def write_row(self, slot: int, buf: memoryview) -> int:
        """Writes `buf` (disk_row_bytes, aligned) as row `slot`; the bytes written."""
        f = self.faults
        if f.write_slow_s:
            time.sleep(f.write_slow_s)
        if f.write_eio:
            raise OSError(errno.EIO, "injected write error (KVD_DISK_FAULTS)")
        at = self.offset(slot)
        n = os.pwritev(self.fd, [buf[: self.disk_row_bytes]], at)
        if not self.direct:  # buffered: Linux starts the write-back, drops the pages after
            os.posix_fadvise(self.fd, at, n, os.POSIX_FADV_DONTNEED)
        return n

    def sync(self) -> None:
        """The entry table and checksums (and buffered rows) to the device, with
        fsync, which waits without the GIL: on a thread of its own, never the
        loop. After a power loss the table names fewer rows, never others."""
        if not self.enter():
            return
        try:
            if not self.direct:
                os.fdatasync(self.fd)
            os.fsync(self.efd)  # also the pages written through the table's mapping
        except OSError as exc:  # the disk failed: counted by the reads that follow
            log.warning("event=disk_sync_failed path=%s reason=%s", self.path, exc)
        finally:
            self.leave()

    def enter(self) -> bool:
        """Before a thread's I/O: False once the slab is closing (skip the row).
        The descriptors stay open until `leave`, so no I/O reaches a reused one."""
        with self._lock:
            if self.closed:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            last = self.closed and self._users == 0
        if last:
            self._close_files()

    def close(self) -> None:
        """Unmaps the table (on the loop, which alone writes it); the descriptors
        (and the lock) go now, or when the last thread using them leaves. Nothing
        here waits on the disk: what the table holds reaches it by write-back."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            idle = self._users == 0
        self.crcs.release()
        self._crc_map.close()
        self.table.close()
        if idle:
            self._close_files()

    def _close_files(self) -> None:
        os.close(self.efd)
        os.close(self.fd)  # the lock goes with the last descriptor

    def remove(self) -> None:
        """Closes and deletes both files (the pool was dropped)."""
        self.close()
        for path in (self.path, self.path.with_suffix(".entries")):
            path.unlink(missing_ok=True)


def slab_path(disk_dir: str, pool: str) -> Path:
    return Path(disk_dir) / f"{pool}.slab"


def open_slab(
    disk_dir: str,
    entries_header: SegmentHeader,
    *,
    adopt: bool,
    max_blocks: int | None = None,
) -> tuple[Slab, str]:
    """The pool's slab: the existing one when `adopt` and every check passes (of
    any size up to `max_blocks` rows: a share that changed since keeps it),
    else a new empty one of `entries_header.num_blocks` rows (the reason the old
    one was not adopted is returned, "" if adopted or none was there).
    `entries_header` is what the pool's entry table must say, but for its
    generation (the slab's id) and size (`max_blocks` None: at most its size).
    Raises SlabError (no room, locked)."""
    pool = entries_header.name
    path = slab_path(disk_dir, pool)
    faults = Faults.from_env()
    reason = ""
    if adopt and path.exists():
        try:
            limit = entries_header.num_blocks if max_blocks is None else max_blocks
            return _adopt(path, entries_header, faults, limit), ""
        except BadSegment as exc:
            reason = str(exc)
        except FileNotFoundError:
            reason = "its entry table is missing"
    elif path.with_suffix(".entries").exists() and adopt:
        reason = "its slab is missing"
    return _create(path, entries_header, faults), reason


def _lock(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SlabError(errno.EBUSY, f"{path} is in use by another kvd daemon") from None


def _adopt(path: Path, want: SegmentHeader, faults: Faults, max_blocks: int) -> Slab:
    fd, direct = _open_direct(path)
    _lock(fd, path)
    efd = -1
    try:
        slab_id, n, row, _, print_ = check_slab_header(_pread_aligned(fd, ALIGN, 0))
        if row != want.row_bytes:
            raise BadSegment(f"slab holds rows of {row} bytes, the pool's are {want.row_bytes}")
        if print_ != hashlib.sha256(want.layout).digest():
            raise BadSegment("slab was made for another layout")
        if n > max_blocks:
            raise BadSegment(f"slab holds {n} rows, more than the {max_blocks} its share leaves")
        size = os.fstat(fd).st_size
        if size < ALIGN + n * round_up(row):
            raise BadSegment(
                f"slab truncated: {size} bytes, its rows need {ALIGN + n * round_up(row)}"
            )
        efd = os.open(path.with_suffix(".entries"), os.O_RDWR | os.O_CLOEXEC)
        header = _read_entries_header(efd)
        if header.generation != slab_id:
            raise BadSegment("entry table belongs to another slab")
        if (header.name, header.num_blocks, header.row_bytes, header.layout) != (
            want.name, n, row, want.layout,
        ):  # fmt: skip
            raise BadSegment("entry table disagrees with its slab or the pool's layout")
        if os.fstat(efd).st_size != _entries_size(header):
            raise BadSegment("entry table truncated")
        table = SlotTable(efd, header, fresh=False)
        try:
            crc_map = mmap.mmap(efd, _entries_size(header) - header.data_offset,
                                offset=header.data_offset)  # fmt: skip
        except BaseException:
            table.close()
            raise
    except BaseException:
        if efd >= 0:
            os.close(efd)
        os.close(fd)
        raise
    return Slab(path, fd, direct, efd, table, crc_map, header, faults)


def _pread_aligned(fd: int, size: int, offset: int) -> bytes:
    with mmap.mmap(-1, size) as buf:  # page aligned: an O_DIRECT descriptor takes it
        return bytes(buf[: os.preadv(fd, [buf], offset)])


def _read_entries_header(fd: int) -> SegmentHeader:
    """The entry table's header (a segment header whose size check counts the
    table only); BadSegment when it does not hold."""
    first = os.pread(fd, MAX_HEADER_BYTES, 0)
    if len(first) < HEADER.size:
        raise BadSegment("entry table shorter than its header")
    fields = HEADER.unpack(first[: HEADER.size])
    num_blocks, row_bytes, data_offset = fields[4], fields[5], fields[11]
    return read_header(first, data_offset + num_blocks * row_bytes)


def _create(path: Path, want: SegmentHeader, faults: Faults) -> Slab:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    _lock(fd, path)
    os.close(fd)  # reopened below, with O_DIRECT; the lock is re-taken first
    slab_id = int.from_bytes(os.urandom(8), "little") >> 1
    header = SegmentHeader(slab_id, want.num_blocks, want.row_bytes, want.slot_bytes,
                           want.num_slots, want.slot_stride, want.replicated, want.name,
                           want.layout, want.policy)  # fmt: skip
    fd, direct = _open_direct(path)
    # Outside the try: a daemon that took the lock since is refused, its files
    # stay, and `_lock` closed the descriptor already.
    _lock(fd, path)
    epath = path.with_suffix(".entries")
    efd = -1
    table: SlotTable | None = None
    crc_map: mmap.mmap | None = None
    try:
        os.ftruncate(fd, 0)  # whatever was there goes, its rows with it
        _reserve(fd, ALIGN + header.num_blocks * round_up(header.row_bytes), path)
        efd = os.open(epath, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        _reserve(efd, _entries_size(header), epath)
        table = SlotTable(efd, header, fresh=True)
        crc_map = mmap.mmap(efd, _entries_size(header) - header.data_offset,
                            offset=header.data_offset)  # fmt: skip
        print_ = hashlib.sha256(header.layout).digest()
        page = mmap.mmap(-1, ALIGN)
        try:
            page[: SLAB_HEADER.size] = slab_header(slab_id, header.num_blocks, header.row_bytes,
                                                    round_up(header.row_bytes), print_)  # fmt: skip
            os.pwritev(fd, [page], 0)
        finally:
            page.close()
        os.fsync(fd)
        slab = Slab(path, fd, direct, efd, table, crc_map, header, faults)
        slab.created = True
    except BaseException:
        for made in (epath, path):  # nothing half-made stays (the slab, locked, last)
            made.unlink(missing_ok=True)
        if crc_map is not None:
            crc_map.close()
        if table is not None:
            table.close()
        if efd >= 0:
            os.close(efd)
        os.close(fd)
        raise
    return slab
