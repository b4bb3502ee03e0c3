"""Runs in the daemon: one POSIX shared-memory segment, its owner and its cleanup.

The daemon creates, sizes, prefaults and finally unlinks each pool's segment;
it never reads or writes block data. Workers map the same segment by name.

Cleanup order: `close()` unmaps, then unlinks the name (engines that still map
it keep their pages until they unmap), then drops the manifest entry. The
manifest (`<runtime_dir>/segments`) lists every segment this runtime dir
created, so a restart unlinks exactly the stale segments of its own earlier
run and never another daemon's.
"""

from __future__ import annotations

import grp
import logging
import mmap
import os
from pathlib import Path
from types import TracebackType

import posix_ipc

log = logging.getLogger("kvd.io.region")
_CHUNK = 64 << 20
# Python < 3.13 lacks the constant; Linux >= 5.14 has it (EINVAL before).
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)


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
        self, name: str, size: int, *, gid: int | None, prefault: bool, manifest: Manifest
    ) -> None:
        self.name = name
        self.size = size
        self._manifest = manifest
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
                self._prefault(shm.fd, size)
        except BaseException:
            shm.close_fd()
            self._unlink()
            raise
        shm.close_fd()

    @staticmethod
    def _prefault(fd: int, size: int) -> None:
        # Allocate every page now so page faults never land in a transfer.
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            try:
                mm.madvise(MADV_POPULATE_WRITE)
                return
            except OSError:
                pass  # kernel older than 5.14: touch the pages instead
            zeros = bytes(min(_CHUNK, size))
            for off in range(0, size, _CHUNK):
                n = min(_CHUNK, size - off)
                mm[off : off + n] = zeros[:n]

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
