"""Runs in the daemon: one POSIX shared-memory segment, its owner and its cleanup.

The daemon creates, sizes, prefaults and finally unlinks each pool's segment;
it never reads or writes block data. Workers map the same segment by name.

Prefaulting allocates every page up front so that page allocation never lands
in a transfer. It runs on a thread of its own (`posix_fallocate`, which
releases the GIL and keeps whatever the pages already hold), so the event
loop keeps answering while a large pool is allocated (0.3 s per GiB here)
and engines may attach and copy meanwhile. Whether the segment fits in the
shared-memory filesystem is checked before, on the caller's thread, so a
pool that cannot be backed is refused at once rather than failing later.

Cleanup order: `close()` unmaps, then unlinks the name (engines that still map
it keep their pages until they unmap), then drops the manifest entry. The
manifest (`<runtime_dir>/segments`) lists every segment this runtime dir
created, so a restart unlinks exactly the stale segments of its own earlier
run and never another daemon's.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import threading
import time
from pathlib import Path
from types import TracebackType

import posix_ipc

log = logging.getLogger("kvd.io.region")


class Manifest:
    """The file listing the segments a runtime dir's daemon created."""

    def __init__(self, path: Path) -> None:
        self.path = path

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
        self._write([*self.names(), name])

    def remove(self, name: str) -> None:
        self._write([n for n in self.names() if n != name])

    def unlink_stale(self) -> list[str]:
        """Unlinks every segment listed by an earlier run; returns their names."""
        gone = []
        for name in self.names():
            try:
                posix_ipc.unlink_shared_memory(name)
                gone.append(name)
            except posix_ipc.ExistentialError:
                pass  # already gone (e.g. after a reboot): nothing to unlink
        self._write([])
        return gone


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


class SharedRegion:
    """A created segment. Owns the name (unlinked on close) and a prefault mapping."""

    def __init__(
        self,
        name: str,
        size: int,
        *,
        gid: int | None,
        prefault: bool,
        manifest: Manifest,
        reserved: int = 0,
    ) -> None:
        """`reserved`: bytes other segments are still being prefaulted with, so
        their pages count as taken when this one checks for room."""
        self.name = name
        self.size = size
        self._manifest = manifest
        self._prefaulter: threading.Thread | None = None
        self.prefault_error: str | None = None  # set by the prefault thread when it failed
        mode = 0o660 if gid is not None else 0o600
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=size)
        except posix_ipc.ExistentialError:
            raise FileExistsError(f"shared memory segment {name} already exists") from None
        manifest.add(name)
        try:
            # posix_ipc's mode passes through the umask; set it exactly.
            os.fchmod(shm.fd, mode)
            if gid is not None:
                os.fchown(shm.fd, -1, gid)
            if prefault:
                self._check_room(shm.fd, size + reserved)
                self._prefaulter = threading.Thread(
                    target=self._prefault,
                    args=(os.dup(shm.fd), size),
                    name=f"kvd-prefault{name.replace('/', '-')}",
                    daemon=True,
                )
                self._prefaulter.start()
        except BaseException:
            shm.close_fd()
            self._unlink()
            raise
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

    def _unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            log.warning("event=segment_already_gone name=%s", self.name)
        self._manifest.remove(self.name)

    def close(self) -> None:
        if self.size >= 0:
            self._unlink()
            self.size = -1

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
