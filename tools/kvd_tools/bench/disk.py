"""Runs in the bench: `kvd bench disk`, the disk tier vs the bare disk and files (SPEC 16).

For each row size (`--row-bytes`, default 256 KiB and 2 MiB): one private
daemon with a disk tier at `--queue-depth` I/O threads (the daemon's
default, 16), its disk dir a directory of its own under `--dir` (/tmp: ext4
here), and one pool whose RAM holds four times a round's blocks (nothing is
evicted while a round is stored, and one lookup fetches the whole round: a
fetch takes at most a quarter of the pool) over a slab of twice a round's.
Each of `--rounds` rounds stores `--mib` MiB of new blocks and reads them
back, by kvd, bare and a file per block, one after the other:

- kvd store: the blocks are prepared and their rows written through this
  process's mapping of the pool (as a worker's copy would), then completed
  in one `complete_store`: from then until `disk.blocks_written` counts them
  all (polled every 5 ms), the daemon's write-behind copies each row into an
  I/O thread's buffer with its CRC-32C and writes it (`O_DIRECT`).
- bare write: as many rows, at the same offsets of a preallocated file, in
  the same order, `O_DIRECT`, same queue depth, each from its thread's
  buffer, as the daemon writes (`kvd_tools.bench.disk_io`).
- files store: each row to a file of its own, as vLLM's fs tier writes it.
- a simulated reboot: the daemon SIGKILLed, the pool's segments unlinked, the
  daemon started again: the pool comes back empty, the slab is adopted.
- kvd fetch: from the first lookup of the blocks (None: the daemon reads
  them into fresh slots, checks each row's CRC-32C, then makes them ready)
  to the lookup that hits (polled every 5 ms); then a sample of rows is
  checked against the bytes stored.
- bare read: the same rows of the same slab, found in its entry table, read
  in the same order with `O_DIRECT` at the same queue depth.
- files load: each block's file read into its place in a buffer, the files'
  pages dropped from the cache first (`O_DIRECT` bypasses it anyway).

The order turns from round to round (kvd's store first, as the baselines
write its rows, then bare and files in turn; after the reboot kvd, bare and
files in turn), and each timed step starts after `os.sync()`: here the
disk is virtual, and a write step's figure depended on whether the one
before it was still draining from the host's cache (the guest's flush
reaches the host). Before the timed steps each round stores (and after the reboot fetches)
WARM_BLOCKS blocks of its own: the daemon populates its mapping of a pool on
first use (0.2 s per GiB) and each I/O thread's buffer faults in on its
first row; a daemon in service has done both. Figures are medians over the
rounds, with min and max; CPU seconds per GB are the daemon's (from
/proc/<pid>/stat over the step) for kvd, this process's for the baselines.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import mmap
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd.io.disk_slab import round_up
from kvd_tools.bench import disk_io
from kvd_tools.bench.disk_report import GBPS, row_of, summarize
from kvd_tools.bench.disk_setup import (
    RowBytes,
    counter,
    disk_bytes_for,
    disk_dir,
    disk_flags,
    slab_file,
    slab_offset,
    slab_slots,
    wait_until,
)
from kvd_tools.bench.restarts import cpu_s, daemon_pid, restart, wait_quiet
from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.launcher import DaemonProcess

__all__ = ["run", "summarize"]  # summarize: the suite's, from disk_report

POOL = "bench-disk"
WARM_BLOCKS = 32
POLL_S = 0.005
SAMPLE = 64  # rows checked byte for byte after each fetch


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _layout(row_bytes: int) -> Any:
    from kvd_client import Layout

    return Layout(f"bench-disk-{row_bytes}", "bfloat16", 16, 1, False, row_bytes)


def _keys(row_bytes: int, rnd: int | str, n: int) -> list[bytes]:
    """As vLLM's offload keys: a 32-byte block hash, then KV-cache group 0."""
    return [hashlib.blake2b(f"{row_bytes}/{rnd}/{i}".encode(), digest_size=32).digest()
            + bytes(4) for i in range(n)]  # fmt: skip


@dataclass
class Attached:
    """A scheduler on the bench pool (`s`), and this process's mapping of its rows."""

    s: Any
    rows: mmap.mmap


@contextlib.contextmanager
def _attached(daemon: DaemonProcess, layout: Any, capacity: int) -> Iterator[Attached]:
    from kvd_client import Scheduler
    from kvd_client.worker import Mapping

    with Scheduler(POOL, layout, engine_id="bench", endpoint=daemon.endpoint,
                   capacity_bytes=capacity, timeout_ms=60_000) as s:  # fmt: skip
        assert s.attached is not None
        mapping = Mapping(s.attached, replicated=False)
        try:
            yield Attached(s, mapping.mm)
        finally:
            mapping.close()


def _prepare(p: Attached, data: RowBytes, keys: list[bytes]) -> list[int]:
    """The blocks' slots, their rows written; not yet complete."""
    from kvd_tools.bench.suites import SuiteError

    out = p.s.prepare_store(keys)
    if out is None or list(out.keys_to_store) != keys:
        raise SuiteError("the pool did not take every block")
    slots = list(out.store_spec.slots)
    for key, slot in zip(keys, slots, strict=True):
        data.fill(p.rows, slot * data.row_bytes, key)
    return slots


def _written(s: Any, base: dict[str, int], n: int) -> bool:
    from kvd_tools.bench.suites import SuiteError

    c = s.stats().counters
    for name in ("disk.writes_skipped", "disk.writes_failed", "disk.errors"):
        if c.get(name, 0) > base[name]:
            raise SuiteError(f"the write-behind lost blocks ({name} went up)")
    return bool(c.get("disk.blocks_written", 0) >= base["disk.blocks_written"] + n)


def _kvd_store(
    p: Attached, data: RowBytes, keys: list[bytes], pid: int
) -> tuple[list[int], float, float]:
    """(RAM slots, seconds, daemon CPU seconds) of the write-behind of `keys`."""
    slots = _prepare(p, data, keys)
    c = p.s.stats().counters
    base = {name: c.get(name, 0) for name in ("disk.blocks_written", "disk.writes_skipped",
                                              "disk.writes_failed", "disk.errors")}  # fmt: skip
    wait_quiet(pid)
    c0, t0 = cpu_s(pid), time.perf_counter()
    p.s.complete_store(keys)
    wait_until("the disk write-behind", lambda: _written(p.s, base, len(keys)), 600, POLL_S)
    return slots, time.perf_counter() - t0, cpu_s(pid) - c0


def _kvd_fetch(p: Attached, keys: list[bytes], pid: int) -> tuple[float, float]:
    """(seconds, daemon CPU seconds) from the first lookup of `keys` to the hit."""
    from kvd_tools.bench.suites import SuiteError

    wait_quiet(pid)
    c0, t0 = cpu_s(pid), time.perf_counter()
    if p.s.lookup(keys) is not None:
        raise SuiteError("the first lookup after the reboot did not go to the disk")
    # The fetch makes every block ready at once: its last key hitting is the end.
    _fetched(p.s, keys[-1:])
    seconds, cpu = time.perf_counter() - t0, cpu_s(pid) - c0
    _fetched(p.s, keys)
    return seconds, cpu


def _fetched(s: Any, keys: list[bytes], timeout_s: float = 600) -> None:
    """Lookups of `keys` until one answers; SuiteError unless it hits them all."""
    from kvd_tools.bench.suites import SuiteError

    deadline = time.monotonic() + timeout_s
    while (hits := s.lookup(keys)) is None:
        if time.monotonic() > deadline:
            raise SuiteError(f"the disk fetch did not end within {timeout_s} s")
        time.sleep(POLL_S)
    if hits != len(keys):
        raise SuiteError(f"{hits} of {len(keys)} blocks came back from the disk")


def _verify(p: Attached, data: RowBytes, keys: list[bytes]) -> tuple[int, int]:
    """(rows checked, rows equal to what was stored), a sample of `keys`."""
    sample = keys[:: max(1, len(keys) // SAMPLE)]
    slots = p.s.prepare_load(sample).slots
    try:
        equal = sum(data.matches(p.rows, slot * data.row_bytes, k)
                    for k, slot in zip(sample, slots, strict=True))  # fmt: skip
    finally:
        p.s.complete_load(sample)
    return len(sample), equal


class Sizes:
    """One row size's blocks, pool and slab (see the module)."""

    def __init__(self, row_bytes: int, args: argparse.Namespace) -> None:
        self.row_bytes = row_bytes
        self.n: int = max(1, (args.mib << 20) // row_bytes)
        self.layout = _layout(row_bytes)
        per_round = self.n + WARM_BLOCKS
        self.capacity = 4 * per_round * row_bytes
        self.max_total = int(max_total_bytes([pool_footprint(POOL, self.layout, self.capacity)]))
        self.disk_bytes = disk_bytes_for(2 * per_round + 2, row_bytes, self.capacity,
                                         self.max_total)  # fmt: skip
        self.write_max = max(256 << 20, 2 * per_round * row_bytes)
        self.qd = args.queue_depth

    @property
    def nbytes(self) -> int:
        return self.n * self.row_bytes


def _views(mm: Any, slots: list[int], row: int) -> tuple[memoryview, list[memoryview]]:
    whole = memoryview(mm)
    return whole, [whole[s * row : (s + 1) * row] for s in slots]


def _release(whole: memoryview, views: list[memoryview]) -> None:
    for v in views:
        v.release()
    whole.release()


Step = Callable[[], dict[str, float]]


def _rotated(steps: list[Step], rnd: int) -> dict[str, float]:
    """The steps one after the other, round `rnd` starting with step `rnd` (mod
    their number): over the rounds each goes first, second, ... as often."""
    k = rnd % len(steps)
    figures: dict[str, float] = {}
    for step in steps[k:] + steps[:k]:
        os.sync()  # each starts with the writes before it on the disk (see the module)
        figures |= step()
    return figures


def _per_gb(name: str, timing: disk_io.Timing, sz: Sizes, cpu: str) -> dict[str, float]:
    return {f"{name}_gbps": timing.gbps(sz.nbytes), cpu: timing.cpu_s / (sz.nbytes / 1e9)}


def _stores(p: Attached, sz: Sizes, data: RowBytes, keys: list[bytes], where: Path,
            pid: int, rnd: int) -> dict[str, float]:  # fmt: skip
    """The round's stores: kvd's, then bare and files (their order turning)."""
    os.sync()
    slots, seconds, cpu = _kvd_store(p, data, keys, pid)
    figures = {"store_gbps": sz.nbytes / 1e9 / seconds,
               "daemon_cpu_s_per_gb_write": cpu / (sz.nbytes / 1e9)}  # fmt: skip
    offsets = [slab_offset(slot, sz.row_bytes) for slot in slab_slots(where, POOL, keys)]
    whole, rows = _views(p.rows, slots, sz.row_bytes)
    try:
        return figures | _rotated([lambda: _bare_writes(sz, offsets, rows, where),
                                   lambda: _files_writes(sz, keys, rows, where)], rnd)  # fmt: skip
    finally:
        _release(whole, rows)


def _bare_writes(sz: Sizes, offsets: list[int], rows: list[memoryview],
                 where: Path) -> dict[str, float]:  # fmt: skip
    bare = disk_io.bare_write(where / "bare.slab", offsets, bytes(rows[0]), sz.qd)
    return _per_gb("bare_write", bare, sz, "bare_cpu_s_per_gb_write")


def _files_writes(sz: Sizes, keys: list[bytes], rows: list[memoryview],
                  where: Path) -> dict[str, float]:  # fmt: skip
    files = disk_io.files_store(_files(where, keys), rows, sz.qd)
    return _per_gb("files_store", files, sz, "files_cpu_s_per_gb_write")


def _files(where: Path, keys: list[bytes]) -> list[Path]:
    return [disk_io.block_file(where / "files" / "bench", k) for k in keys]


def _kvd_reads(p: Attached, sz: Sizes, data: RowBytes, keys: list[bytes],
               pid: int) -> dict[str, float]:  # fmt: skip
    seconds, cpu = _kvd_fetch(p, keys, pid)
    checked, equal = _verify(p, data, keys)
    return {"fetch_gbps": sz.nbytes / 1e9 / seconds,
            "daemon_cpu_s_per_gb_read": cpu / (sz.nbytes / 1e9),
            "blocks_checked": checked, "blocks_verified": equal}  # fmt: skip


def _bare_reads(sz: Sizes, keys: list[bytes], where: Path) -> dict[str, float]:
    offsets = [slab_offset(slot, sz.row_bytes) for slot in slab_slots(where, POOL, keys)]
    bare = disk_io.bare_read(slab_file(where, POOL), offsets, round_up(sz.row_bytes), sz.qd)
    return _per_gb("bare_read", bare, sz, "bare_cpu_s_per_gb_read")


def _files_reads(sz: Sizes, keys: list[bytes], where: Path) -> dict[str, float]:
    paths = _files(where, keys)
    dest = disk_io.aligned_buffer(sz.nbytes)
    whole, places = _views(dest, list(range(sz.n)), sz.row_bytes)
    try:
        disk_io.drop_cached(paths)
        files = disk_io.files_load(paths, places, sz.qd)
    finally:
        _release(whole, places)
        dest.close()
    return _per_gb("files_load", files, sz, "files_cpu_s_per_gb_read")


def _loads(p: Attached, sz: Sizes, data: RowBytes, keys: list[bytes], where: Path,
           pid: int, rnd: int) -> dict[str, float]:  # fmt: skip
    """The round's three reads after the reboot (their order turning); their figures."""
    return _rotated([lambda: _kvd_reads(p, sz, data, keys, pid),
                     lambda: _bare_reads(sz, keys, where),
                     lambda: _files_reads(sz, keys, where)], rnd)  # fmt: skip


def _warm_store(p: Attached, data: RowBytes, keys: list[bytes]) -> None:
    base = {name: counter(p.s, name) for name in ("disk.blocks_written", "disk.writes_skipped",
                                                "disk.writes_failed", "disk.errors")}  # fmt: skip
    _prepare(p, data, keys)
    p.s.complete_store(keys)
    wait_until("the warm-up's write-behind", lambda: _written(p.s, base, len(keys)), 120, POLL_S)


def _round(daemon: DaemonProcess, sz: Sizes, data: RowBytes, where: Path,
           rnd: int) -> dict[str, float]:  # fmt: skip
    keys, warm = _keys(sz.row_bytes, rnd, sz.n), _keys(sz.row_bytes, f"warm{rnd}", WARM_BLOCKS)
    with _attached(daemon, sz.layout, sz.capacity) as p:
        _warm_store(p, data, warm)
        figures = _stores(p, sz, data, keys, where, daemon_pid(daemon), rnd)
    restart(daemon, reboot=True)
    try:
        with _attached(daemon, sz.layout, sz.capacity) as p:
            _fetched(p.s, warm, timeout_s=120)
            c0 = p.s.stats().counters
            figures |= _loads(p, sz, data, keys, where, daemon_pid(daemon), rnd)
            c1 = p.s.stats().counters
    finally:
        shutil.rmtree(where / "files", ignore_errors=True)
    for name in ("disk.bad_rows", "disk.errors"):
        figures[name] = c1.get(name, 0) - c0.get(name, 0)
    return figures


def _one_size(row_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    sz = Sizes(row_bytes, args)
    data = RowBytes(row_bytes)
    load = os.getloadavg()[0]
    rounds: list[dict[str, float]] = []
    with disk_dir(args.dir) as where:
        flags = disk_flags(where, max_total=sz.max_total, disk_bytes=sz.disk_bytes,
                           disk_queue_depth=str(args.queue_depth),
                           disk_write_max_bytes=str(sz.write_max))  # fmt: skip
        daemon = DaemonProcess(base=flags)
        try:
            daemon.start()
            for rnd in range(args.rounds):
                rounds.append(_round(daemon, sz, data, where, rnd))
                r = rounds[-1]
                _log(f"disk: {row_bytes} B round {rnd}: " + ", ".join(
                    f"{k.removesuffix('_gbps')} {r[k]:.2f}" for k in GBPS) + " GB/s")  # fmt: skip
        finally:
            daemon.stop()
    return row_of(sz.row_bytes, sz.qd, sz.n, rounds, load)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [_one_size(row_bytes, args) for row_bytes in args.row_bytes]
