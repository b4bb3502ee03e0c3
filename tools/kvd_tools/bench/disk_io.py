"""Runs in the bench: the baselines of `kvd bench disk`, the disk without kvd (SPEC 10, 16).

Each moves the same rows as the daemon, at the same queue depth: `count`
threads, each with its own buffer, take the next row from one shared list
(in the list's order) until none is left, so that `count` rows are in
flight at once, as in the daemon's `kvd.io.disk_threads`.

- `bare_write` / `bare_read`: `os.pwritev` / `os.preadv` with `O_DIRECT`
  at the rows' offsets in one preallocated file, from and into each
  thread's aligned buffer; nothing else per row (no copy, no checksum): the
  disk's own speed through Python threads. A write buffer holds a row's
  bytes (the first row's, copied in before the clock starts): writing each
  row from where it lies in the pool's mapping instead was 0.7x as fast at
  256 KiB here (every row's pages pinned for the I/O, where a reused buffer's
  are pinned again and again), slower than the daemon's own path, which
  copies each row into its thread's buffer first.
- `files_store` / `files_load`: one file per block, as vLLM's fs tier does
  it (vllm/v1/kv_offload/tiering/fs/io.py `_store_block` and `_load_block`,
  over 16 threads of its fs/thread_pool.py `DualQueueThreadPool`): a store
  checks the block's file does not exist, makes its directories, opens a
  temporary file (`O_CREAT | O_EXCL | O_WRONLY | O_TRUNC | O_DIRECT`),
  writes the row, closes it and renames it over the block's name; a load
  opens the file (`O_RDONLY | O_DIRECT`), `readv`s the row into its place
  and closes it. File names as vLLM's `FileMapper`:
  `<root>_r0/<hhh>/<hh>_g<group>/<hash hex>.bin`. `O_DIRECT` bypasses the
  page cache; `drop_cached` also asks the kernel to drop each file's pages
  (`POSIX_FADV_DONTNEED`) before a timed load, in case the filesystem did
  not take `O_DIRECT`.

Each returns a `Timing`: wall seconds from the first row handed out to the
last row done (threads and buffers are made before), and this process's CPU
seconds (all threads, user + system) meanwhile.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ALIGN = 4096
FILE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT


@dataclass(frozen=True)
class Timing:
    seconds: float
    cpu_s: float  # this process, user + system

    def gbps(self, nbytes: int) -> float:
        return nbytes / max(self.seconds, 1e-9) / 1e9


def process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def aligned_buffer(size: int) -> mmap.mmap:
    """An anonymous mapping (page aligned, so O_DIRECT takes it), its pages touched."""
    buf = mmap.mmap(-1, max(size, ALIGN))
    buf.write(bytes(len(buf)))
    return buf


Work = Callable[[int, memoryview], None]  # (row index, the thread's buffer)


def run_threads(
    count: int, num_rows: int, buffer_bytes: int, work: Work, fill: bytes = b""
) -> Timing:
    """`work(i, buffer)` for every i in range(num_rows), in order, on `count` threads;
    each thread's buffer starts with `fill` (zeros after it), before the clock.
    The first exception of a thread is raised here once all have stopped."""
    lock = threading.Lock()
    next_row = [0]
    errors: list[BaseException] = []
    gate = threading.Barrier(count + 1)

    def loop() -> None:
        buf = aligned_buffer(buffer_bytes) if buffer_bytes else None
        view = memoryview(buf) if buf is not None else memoryview(bytearray())
        try:
            view[: len(fill)] = fill
            gate.wait()
            while not errors:
                with lock:
                    i = next_row[0]
                    next_row[0] += 1
                if i >= num_rows:
                    return
                work(i, view)
        except BaseException as exc:  # reported by the caller's thread
            errors.append(exc)
            gate.abort()  # a thread that never reached the gate must not hold the others
        finally:
            view.release()
            if buf is not None:
                buf.close()

    threads = [threading.Thread(target=loop, name=f"bench-io-{i}") for i in range(count)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        gate.wait()
    t0, c0 = time.perf_counter(), process_cpu_s()
    for t in threads:
        t.join()
    timing = Timing(time.perf_counter() - t0, process_cpu_s() - c0)
    if errors:
        raise errors[0]
    return timing


def _whole(n: int, want: int, what: str) -> None:
    if n != want:
        raise OSError(f"short {what}: {n} of {want} bytes")


def bare_write(path: Path, offsets: Sequence[int], row: bytes, qd: int) -> Timing:
    """A row's bytes written at each of `offsets` of `path` (made and reserved
    first), O_DIRECT, from each thread's buffer."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(offsets) + len(row))

        def one(i: int, buf: memoryview) -> None:
            _whole(os.pwritev(fd, [buf], offsets[i]), len(row), "write")

        return run_threads(qd, len(offsets), len(row), one, fill=row)
    finally:
        os.close(fd)


def bare_read(path: Path, offsets: Sequence[int], row_bytes: int, qd: int) -> Timing:
    """The rows of `row_bytes` at `offsets` of `path` read with O_DIRECT, each into
    its thread's aligned buffer."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:

        def one(i: int, buf: memoryview) -> None:
            _whole(os.preadv(fd, [buf], offsets[i]), row_bytes, "read")

        return run_threads(qd, len(offsets), row_bytes, one)
    finally:
        os.close(fd)


def block_file(root: Path, key: bytes) -> Path:
    """vLLM's FileMapper name of a block (rank 0): `<root>_r0/<hhh>/<hh>_g<group>/<hash>.bin`,
    the key being a 32-byte block hash then the KV-cache group (u32, big-endian)."""
    hash_hex = key[:32].hex()
    group = int.from_bytes(key[32:36] or bytes(4), "big")
    return Path(f"{root}_r0") / hash_hex[:3] / f"{hash_hex[3:5]}_g{group}" / f"{hash_hex}.bin"


def files_store(paths: Sequence[Path], rows: Sequence[memoryview], qd: int) -> Timing:
    """One file per block, written as vLLM's fs tier writes one (see the module)."""
    tmp_suffix = f"_{os.getpid()}_{{}}.tmp"

    def one(i: int, _: memoryview) -> None:
        dest = paths[i]
        if dest.exists():
            return
        tmp = f"{dest}{tmp_suffix.format(threading.get_ident())}"
        os.makedirs(dest.parent, exist_ok=True)
        fd = os.open(tmp, FILE_FLAGS, 0o644)
        try:
            _whole(os.write(fd, rows[i]), len(rows[i]), "write")
        finally:
            os.close(fd)
        os.replace(tmp, dest)

    return run_threads(qd, len(paths), 0, one)


def drop_cached(paths: Sequence[Path]) -> None:
    """Each file's pages out of the page cache (POSIX_FADV_DONTNEED), not timed."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_load(paths: Sequence[Path], dest: Sequence[memoryview], qd: int) -> Timing:
    """Each block's file read into `dest[i]` (its place in a pool-like buffer)."""

    def one(i: int, _: memoryview) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
        try:
            _whole(os.readv(fd, [dest[i]]), len(dest[i]), "read")
        finally:
            os.close(fd)

    return run_threads(qd, len(paths), 0, one)
