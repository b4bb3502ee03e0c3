"""Runs in the daemon: the disk tier's I/O threads; the event loop never waits on a disk (SPEC 16).

`DiskThreads` runs `disk_queue_depth` threads, each doing one row's I/O at a
time with `preadv`/`pwritev` (which release the GIL), so that many rows are
in flight at once: the queue depth a disk needs for its bandwidth. Reads go
before writes (a read is a request waiting; a write is behind one). Each
thread owns an aligned staging buffer (`Staging`, an anonymous mapping, so
`O_DIRECT` takes it), into which rows are read and from which they are
written: a read whose lookup gave up meanwhile (a stalled disk) lands in
the thread's buffer, never in a pool slot that may have been reused.

`copy_crc` copies a row and computes its CRC-32C in one pass (C, without the
GIL), the check every row passes on its way in and out.
"""

from __future__ import annotations

import collections
import importlib
import logging
import mmap
import threading
import time
from collections.abc import Callable
from typing import Any

from kvd.io.remote_value import crc32c_python

log = logging.getLogger("kvd.io.disk_threads")

_native: Any
try:
    _native = importlib.import_module("kvd_client._crc32c")
except ImportError:  # pragma: no cover - depends on the install
    _native = None


def crc32c(data: bytes | memoryview, crc: int = 0) -> int:
    return _native.crc32c(data, crc) if _native is not None else crc32c_python(data, crc)


def copy_crc(dst: memoryview, src: memoryview, crc: int = 0) -> int:
    """Copies `src` into `dst` (same length); the CRC-32C of `src`, from `crc` on."""
    if _native is not None:
        return int(_native.copy_crc32c(dst, src, crc))
    dst[:] = src
    return crc32c_python(src, crc)


class Staging:
    """One thread's aligned buffer, grown to the largest row asked for."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None

    def get(self, size: int) -> memoryview:
        if self._view is None or len(self._view) < size:
            self.close()
            self._map = mmap.mmap(-1, size)
            self._view = memoryview(self._map)
        return self._view[:size]

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._map is not None:
            self._map.close()
            self._map = None


Task = Callable[[Staging], None]


class DiskThreads:
    """`submit(task, read=...)`: `task(staging)` runs on one of the threads.
    A task never raises (what fails is its own to count); one that does is
    logged and the thread goes on."""

    def __init__(self, count: int) -> None:
        self._reads: collections.deque[Task] = collections.deque()
        self._writes: collections.deque[Task] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvd-disk-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def queued(self) -> int:
        return len(self._reads) + len(self._writes)

    def submit(self, task: Task, *, read: bool) -> None:
        with self._cond:
            (self._reads if read else self._writes).append(task)
            self._cond.notify()

    def submit_many(self, tasks: list[Task], *, read: bool) -> None:
        with self._cond:
            (self._reads if read else self._writes).extend(tasks)
            self._cond.notify(len(tasks))

    def _run(self) -> None:
        staging = Staging()
        cond, reads, writes = self._cond, self._reads, self._writes
        try:
            while True:
                with cond:
                    while not reads and not writes and not self._stopping:
                        cond.wait()
                    if self._stopping:
                        return
                    task = reads.popleft() if reads else writes.popleft()
                try:
                    task(staging)
                except Exception:  # a bug in a task: the thread must live on
                    log.exception("event=disk_task_failed")
                finally:
                    del task  # not kept while idle: it may hold a dropped pool's mapping
        finally:
            staging.close()

    def close(self, timeout_s: float) -> None:
        """Stops the threads once their current rows are done (tasks still queued
        are dropped: their loop parts never run, the daemon is stopping)."""
        with self._cond:
            self._stopping = True
            self._reads.clear()
            self._writes.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s  # one bound for all of them
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
