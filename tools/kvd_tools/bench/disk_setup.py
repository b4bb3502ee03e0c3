"""Runs in the bench: a private daemon with a disk tier, for the disk benches (SPEC 16).

- `disk_dir`: a directory of the bench's own under `parent` (/tmp by
  default: ext4 here, so `O_DIRECT`), removed afterwards with whatever the
  daemon and the baselines left in it.
- `disk_flags`: the daemon's flags, with `disk_bytes` chosen so that the one
  pool of `capacity_bytes` gets a slab of at least `slab_blocks` rows (a
  pool's share is `disk_bytes` times its capacity over `max_total_bytes`,
  `kvd.control.disk_slabs`).
- `RowBytes`: what the bench writes into a block's row: a slice of a random
  buffer that depends on the key, with the key over its first bytes, so
  rows differ, are not compressible, and a row read back can be checked
  against its key without keeping every row.
- `slab_slots`: which row of the pool's slab holds each key, read from the
  slab's entry table (`<pool>.entries`, kvd.io.disk_slab) as a restart
  would: the bare reads go to the very rows the daemon reads.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvd.io.disk_slab import ALIGN, round_up, slab_path
from kvd_client.segment import ENTRY, ENTRY_BYTES, HEADER, READY
from kvd_tools.launcher import PRIVATE_FLAGS

NOISE_BYTES = 8 << 20  # rows start at one of NOISE_BYTES / ALIGN places in it


@contextlib.contextmanager
def disk_dir(parent: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvd-bench-disk-", dir=parent or None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def disk_bytes_for(slab_blocks: int, row_bytes: int, capacity_bytes: int, max_total: int) -> int:
    """`disk_bytes` that gives a pool of `capacity_bytes` rows, in a daemon of
    `max_total` bytes, a slab of at least `slab_blocks` rows (each with its
    entry and checksum; the header pages and some slack on top)."""
    want = slab_blocks * (round_up(row_bytes) + 2 * ENTRY_BYTES) + 4 * ALIGN + (1 << 20)
    return -(-want * max_total // capacity_bytes)


def disk_flags(path: Path, *, max_total: int, disk_bytes: int, **flags: str) -> dict[str, str]:
    base = {**PRIVATE_FLAGS, "max-total-bytes": str(max_total), "disk-dir": str(path),
            "disk-bytes": str(disk_bytes), "disk-timeout-ms": "60000"}  # fmt: skip
    return {**base, **{k.replace("_", "-"): v for k, v in flags.items()}}


class RowBytes:
    """The bytes of a bench block's row, from its key (see the module)."""

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self._noise = memoryview(os.urandom(NOISE_BYTES + row_bytes))

    def _start(self, key: bytes) -> int:
        return zlib.crc32(key) % (NOISE_BYTES // ALIGN) * ALIGN

    def fill(self, mm: Any, at: int, key: bytes) -> None:
        """Row bytes of `key` into `mm[at : at + row_bytes]`."""
        start, k = self._start(key), len(key)
        mm[at + k : at + self.row_bytes] = self._noise[start + k : start + self.row_bytes]
        mm[at : at + k] = key

    def matches(self, mm: Any, at: int, key: bytes) -> bool:
        start, k = self._start(key), len(key)
        return bool(mm[at : at + k] == key and mm[at + k : at + self.row_bytes]
                    == self._noise[start + k : start + self.row_bytes])  # fmt: skip


def slab_file(path: Path, pool: str) -> Path:
    return slab_path(str(path), pool)


def slab_offset(slot: int, row_bytes: int) -> int:
    """Where row `slot` starts in a slab (kvd.io.disk_slab: a header page, then rows)."""
    return ALIGN + slot * round_up(row_bytes)


def slab_slots(path: Path, pool: str, keys: Sequence[bytes]) -> list[int]:
    """Each key's row in the pool's slab, from its entry table (READY entries; a
    key on two, the later store's). KeyError for a key the table does not hold."""
    with open(slab_file(path, pool).with_suffix(".entries"), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        fields = HEADER.unpack_from(mm, 0)
        num_blocks, base = fields[4], fields[10]
        states = mm[base : base + num_blocks * ENTRY_BYTES : ENTRY_BYTES]
        where: dict[bytes, tuple[int, int]] = {}
        slot = states.find(READY)
        while slot >= 0:
            _, klen, _, _, seq, raw = ENTRY.unpack_from(mm, base + slot * ENTRY_BYTES)
            key = raw[:klen]
            if key not in where or where[key][0] < seq:
                where[key] = (seq, slot)
            slot = states.find(READY, slot + 1)
    finally:
        mm.close()
    return [where[k][1] for k in keys]


def counter(s: Any, name: str) -> int:
    return int(s.stats().counters.get(name, 0))


def wait_until(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float) -> None:
    from kvd_tools.bench.suites import SuiteError

    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SuiteError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)
