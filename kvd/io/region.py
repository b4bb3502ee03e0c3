"""Runs in the daemon: one POSIX shared-memory segment, its owner, its slot table and its cleanup.

The daemon creates, sizes, prefaults and finally unlinks each pool's segment;
it reads and writes block data only for the remote tier (`rows`, SPEC 14).
Workers map the same segment by name.
The segment starts with a header and a slot table (`kvd_client.segment`, SPEC
section 13), which the daemon maps and writes (`kvd.io.slot_table`); the rows follow
at `data_offset`. On a warm start (`restart = "warm"`) `SharedRegion.adopt`
opens a segment of an earlier run and checks it: owner, mode, group, size,
header; the pool keeps it, with the ready entries of its slot table.

Prefaulting allocates every page up front so that page allocation never lands
in a transfer. It runs on a thread of its own (`posix_fallocate`, which
releases the GIL and keeps whatever the pages already hold), so the event
loop keeps answering while a large pool is allocated (0.3 s per GiB here)
and engines may attach and copy meanwhile. Whether the segment fits in the
shared-memory filesystem is checked before, on the caller's thread, so a
pool that cannot be backed is refused at once rather than failing later.

Cleanup order: `close()` unmaps, then unlinks the name (engines that still map
it keep their pages until they unmap), then drops the manifest entry;
`release()` (a warm daemon's shutdown) only unmaps. The manifest
(`<runtime_dir>/segments`) lists every segment this runtime dir created, so
a restart adopts or unlinks exactly the segments of its own earlier run and
never another daemon's.
"""

from __future__ import annotations

import errno
import grp
import importlib
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import posix_ipc

from kvd.io.slot_table import SlotTable
from kvd_client.segment import MAX_HEADER_BYTES, BadSegment, SegmentHeader, read_header

log = logging.getLogger("kvd.io.region")

__all__ = [
    "Manifest",
    "Rows",
    "SharedRegion",
    "SlotTable",
    "group_id",
    "segment_mode",
    "unlink_segment",
]

_remote_native: Any
try:  # the remote tier's C part: populating a mapping without the GIL
    _remote_native = importlib.import_module("kvd_client._crc32c")
except ImportError:  # pragma: no cover - depends on the install
    _remote_native = None


class Manifest:
    """The file listing the segments a runtime dir's daemon created. Changed under
    a lock: a pool's ready table is made on a thread (`kvd.control.pool_builds`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        try:
            return [n for n in self.path.read_text().split() if n]
        except FileNotFoundError:
            return []

    def _write(self, names: list[str]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"{n}\n" for n in names))
        tmp.replace(self.path)

    def add(self, name: str) -> None:
        with self._lock:
            self._write([*self.names(), name])

    def remove(self, name: str) -> None:
        with self._lock:
            self._write([n for n in self.names() if n != name])

    @staticmethod
    def pool_names(segments: Sequence[str]) -> list[str]:
        """The pools whose segments these are (`/kvd.<pool>.<n>`; ready tables left out)."""
        return [n[len("/kvd.") :].rpartition(".")[0] for n in segments
                if n.startswith("/kvd.") and not n.endswith(".ready")]  # fmt: skip

    def unlink_stale(self, keep: Sequence[str] = ()) -> list[str]:
        """Unlinks every segment listed by an earlier run but those in `keep`;
        returns the names unlinked."""
        gone = []
        for name in self.names():
            if name in keep:
                continue
            try:
                posix_ipc.unlink_shared_memory(name)
                gone.append(name)
            except posix_ipc.ExistentialError:
                pass  # already gone (e.g. after a reboot): nothing to unlink
            except posix_ipc.Error as exc:  # another user's, in sticky /dev/shm: leave it
                log.warning("event=stale_segment_kept name=%s reason=%s", name, exc)
        with self._lock:
            self._write([n for n in self.names() if n in keep])
        return gone


def unlink_segment(name: str, manifest: Manifest) -> None:
    """Unlinks a segment this daemon will not use and takes it off the manifest;
    one already gone, or another user's, is only logged."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.Error as exc:
        log.warning("event=segment_not_unlinked name=%s reason=%s", name, exc)
    manifest.remove(name)


def group_id(group: str) -> int | None:
    """The gid of the service group (a name or a number), or None when none is configured."""
    if not group:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"group {group!r} does not exist") from None


def segment_mode(gid: int | None) -> int:
    """A pool segment's mode: the service group reads and writes it, no one else."""
    return 0o660 if gid is not None else 0o600


class Rows:
    """A pool's rows (from `data_offset` on), mapped read-write on the first `view()`,
    with every page populated up front (a copy into pages this mapping never
    touched costs four times as much here), in C without the GIL. `view()` runs
    on the remote tier's threads, never on the event loop: populating takes
    0.2 s per GiB. The
    mapping goes when the last view of it does, so a thread that still holds
    one after the pool was dropped writes to pages no one else maps."""

    def __init__(self, name: str, size: int, data_offset: int) -> None:
        self.name, self.size, self.data_offset = name, size, data_offset
        self._lock = threading.Lock()
        self._view: memoryview | None = None

    def view(self) -> memoryview:
        with self._lock:
            if self._view is None:
                shm = posix_ipc.SharedMemory(self.name)
                try:
                    mm = mmap.mmap(shm.fd, self.size)
                finally:
                    shm.close_fd()
                view = memoryview(mm)[self.data_offset :]
                if _remote_native is not None:  # without the GIL; else faults on first use
                    _remote_native.populate(view)
                self._view = view
            return self._view


class SharedRegion:
    """A pool's segment. Owns the name (unlinked on close), a prefault mapping, and
    the mapped header and slot table (`table`)."""

    def __init__(
        self,
        name: str,
        header: SegmentHeader,
        *,
        gid: int | None,
        prefault: bool,
        manifest: Manifest,
        reserved: int = 0,
        adopted: bool = False,
    ) -> None:
        """Creates the segment and writes `header`, or with `adopted` takes over the
        segment of an earlier run that `adopt` checked. `reserved`: bytes other
        segments are still being prefaulted with, so their pages count as taken
        when this one checks for room."""
        self.name = name
        self.header = header
        self.size = size = header.size_bytes
        self._manifest = manifest
        self._prefaulter: threading.Thread | None = None
        self.prefault_error: str | None = None  # set by the prefault thread when it failed
        mode = segment_mode(gid)
        if adopted:
            shm = posix_ipc.SharedMemory(name)
        else:
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
            except posix_ipc.ExistentialError:
                raise FileExistsError(f"shared memory segment {name} already exists") from None
            manifest.add(name)
        try:
            if not adopted:
                # posix_ipc's mode passes through the umask; set it exactly.
                os.fchmod(shm.fd, mode)
                if gid is not None:
                    os.fchown(shm.fd, -1, gid)
                if prefault:
                    self._check_room(shm.fd, size + reserved)
            self.table = SlotTable(shm.fd, header, fresh=not adopted)
            # An adopted segment too, unless every page is there already: its
            # earlier run may have died prefaulting it. (Walking 300 MB of pages
            # that are all there costs half a second of a core at the start.)
            if prefault and not (adopted and os.fstat(shm.fd).st_blocks * 512 >= size):
                self._prefaulter = threading.Thread(
                    target=self._prefault,
                    args=(os.dup(shm.fd), size),
                    name=f"kvd-prefault{name.replace('/', '-')}",
                    daemon=True,
                )
                self._prefaulter.start()
        except BaseException:
            shm.close_fd()
            if not adopted:
                self._unlink()
            raise
        shm.close_fd()

    @staticmethod
    def adopt(name: str, gid: int | None) -> SegmentHeader:
        """The header of an earlier run's segment `name`, after checking that this
        daemon may keep it; `BadSegment` (the reason) if not."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise BadSegment("gone") from None
        except posix_ipc.Error as exc:  # another user's, or a mode that keeps us out
            raise BadSegment(f"cannot be opened: {exc}") from None
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.geteuid():
                raise BadSegment(f"owned by uid {st.st_uid}, not {os.geteuid()}")
            mode = stat.S_IMODE(st.st_mode)
            if mode != segment_mode(gid):
                raise BadSegment(f"mode {mode:o}, not {segment_mode(gid):o}")
            if gid is not None and st.st_gid != gid:
                raise BadSegment(f"group {st.st_gid}, not {gid}")
            return read_header(os.pread(shm.fd, min(st.st_size, MAX_HEADER_BYTES), 0), st.st_size)
        finally:
            shm.close_fd()

    @staticmethod
    def _check_room(fd: int, size: int) -> None:
        st = os.fstatvfs(fd)
        room = st.f_bavail * st.f_frsize
        if room < size:
            raise OSError(
                errno.ENOSPC,
                f"the shared-memory filesystem has {room} bytes free; the segment needs {size}",
            )

    def _prefault(self, fd: int, size: int) -> None:
        """Runs on the prefault thread: allocates every page of the segment."""
        start = time.monotonic()
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:  # the daemon drops the pool (`PoolAdmin.drop_unbacked`)
            log.warning("event=prefault_failed shm=%s reason=%s", self.name, exc)
            self.prefault_error = exc.strerror or str(exc)
        else:
            log.info(
                "event=prefaulted shm=%s bytes=%d seconds=%.3f",
                self.name,
                size,
                time.monotonic() - start,
            )
        finally:
            os.close(fd)

    @property
    def prefaulting(self) -> bool:
        """Whether the prefault thread is still allocating pages."""
        return self._prefaulter is not None and self._prefaulter.is_alive()

    def rows(self) -> Rows:
        """The pool's rows, for the remote tier, which alone reads and writes block
        data in the daemon (mapped on first use, by the thread that uses them)."""
        return Rows(self.name, self.header.size_bytes, self.header.data_offset)

    def _unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            log.warning("event=segment_already_gone name=%s", self.name)
        self._manifest.remove(self.name)

    def close(self) -> None:
        """Unmaps and unlinks: the segment is gone."""
        if self.size >= 0:
            self.table.close()
            self._unlink()
            self.size = -1

    def release(self) -> None:
        """Unmaps and keeps the segment and its manifest entry, for the next run."""
        if self.size >= 0:
            self.table.close()
            self.size = -1

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
