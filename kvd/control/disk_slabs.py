"""Runs in the daemon: each pool's part of the disk tier, its slab and its own index (SPEC 16).

`DiskSlabs.open` gives a pool its `DiskPart` when the pool is made (on the
pool's build thread, or at start): the slab an earlier run left, adopted
when its checks pass (its entries scanned as a warm start scans a segment,
in C, the policy learning in slices afterwards), else a new empty one. A
pool's share of `disk_bytes` is its own `disk_bytes` when `[[pools]]` says
one, else `disk_bytes` times its RAM capacity over `max_total_bytes` (so
every pool keeps the same multiple of its RAM on disk); all the slabs
together never hold more than `disk_bytes`. A slab that cannot be made (no
room on the filesystem, locked by another daemon) leaves the pool without a
disk tier, with one log line; the pool itself is unaffected.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvd.config import Config
from kvd.core.index import BlockIndex
from kvd.core.ownership import OwnedIndex
from kvd.io.disk_slab import ALIGN, Slab, open_slab, round_up, slab_path
from kvd.io.disk_threads import DiskThreads
from kvd_client.geometry import Geometry
from kvd_client.protocol import Layout
from kvd_client.segment import PAGE, SegmentHeader

if TYPE_CHECKING:
    from kvd.control.pools import Pool, PoolRegistry
    from kvd.io.region import Rows

log = logging.getLogger("kvd.control.disk_slabs")

MEDIUM = "STORAGE"  # what vLLM's own disk tier publishes (its fs tier's Medium.STORAGE)
LOCALITY = "LOCAL"


@dataclass(eq=False)
class DiskPart:
    """A pool's slab and the index of what it holds (keys -> rows)."""

    pool: str
    slab: Slab
    owned: OwnedIndex
    epoch: int = 0  # moves at a reset: I/O of an earlier epoch changes nothing
    resetting: bool = False
    adopted: int = 0  # blocks a start took back
    seen: dict[bytes, None] = field(default_factory=dict)  # disk_admit = "second"

    @property
    def index(self) -> BlockIndex:
        return self.owned.index

    @property
    def bytes_used(self) -> int:
        return self.index.num_ready * self.slab.disk_row_bytes

    def begin_reset(self) -> None:
        """The pool is being reset: from now on no entry says READY (a restart
        brings none back), and no read or write starts."""
        self.resetting = True
        self.slab.table.begin_reset()

    def finish_reset(self) -> None:
        self.owned.reset()
        self.slab.table.reset()
        self.seen.clear()
        self.epoch += 1
        self.resetting = False


class DiskLoop:
    """What the disk tier's reads and writes share on the loop: the config, the
    pools, the counters, the I/O threads, `post` (a thread's result to the
    loop) and `rows_of` (a pool's rows, mapped once)."""

    def __init__(
        self,
        config: Config,
        pools: PoolRegistry,
        counters: Counter[str],
        threads: DiskThreads,
        post: Callable[[Callable[[], None]], object],
        rows_of: Callable[[Pool], Rows],
    ) -> None:
        self.config = config
        self.pools = pools
        self.counters = counters
        self.threads = threads
        self.post = post
        self._rows_of = rows_of


class DiskSlabs:
    """The disk tier's slabs, one per pool; thread-safe (pools are built on threads)."""

    def __init__(self, config: Config, *, adopt: bool) -> None:
        self.config = config
        self.adopt = adopt  # a warm start takes slabs back; a cold one empties them
        self.total = config.disk_bytes or _half_free(config.disk_dir)
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}  # pool -> its slab's bytes (reserved while made)
        self.failed = 0  # slabs that could not be made
        if not self.total:
            log.error("event=disk_tier_off dir=%s reason=no room on its filesystem",
                      config.disk_dir)  # fmt: skip

    def share(self, pool: str, capacity_bytes: int) -> int:
        for pc in self.config.pools:
            if pc.name == pool and pc.disk_bytes is not None:
                return pc.disk_bytes
        declared = sum(pc.disk_bytes or 0 for pc in self.config.pools)
        rest = max(0, self.total - declared)
        return rest * capacity_bytes // max(1, self.config.max_total_bytes)

    def open(self, name: str, layout: Layout, geometry: Geometry, policy: str) -> DiskPart | None:
        """The pool's disk part, or None (no share, or its slab failed: logged).
        Never raises."""
        row = round_up(geometry.row_bytes)
        with self._lock:
            left = max(0, self.total - sum(v for k, v in self._sizes.items() if k != name))
            wanted = min(self.share(name, geometry.num_blocks * geometry.row_bytes), left)
            num_blocks = _rows_in(wanted, row)
            # An earlier slab is kept up to a tenth over the share (disk_bytes = 0
            # drifts with the free space), never over a share the config declares.
            declared = any(pc.name == name and pc.disk_bytes is not None
                           for pc in self.config.pools)  # fmt: skip
            cap = wanted if declared else min(left, wanted + wanted // 10)
            if num_blocks < 1:
                if wanted or self.total:
                    log.warning(
                        "event=disk_tier_off pool=%s reason=%s",
                        name,
                        f"its share of disk_bytes ({wanted}) holds no row of {row}",
                    )
                return None
            self._sizes[name] = cap  # reserved while it is made (a concurrent build)
        want = SegmentHeader(0, num_blocks, geometry.row_bytes, geometry.slot_bytes,
                             geometry.num_slots, geometry.slot_stride, geometry.replicated,
                             name, msgspec.msgpack.encode(layout), policy)  # fmt: skip
        start = time.monotonic()
        slab = None
        try:
            slab, refused = open_slab(self.config.disk_dir, want, adopt=self.adopt,
                                      max_blocks=_rows_in(cap, row))  # fmt: skip
            part = self._part(name, slab, refused, layout, policy, start)
        except Exception as exc:  # SlabError (room, lock), OSError, a bad KVD_DISK_FAULTS
            if slab is not None:
                slab.close()
            with self._lock:
                self._sizes.pop(name, None)
                self.failed += 1
            log.error("event=disk_tier_off pool=%s path=%s reason=%s", name,
                      slab_path(self.config.disk_dir, name), exc)  # fmt: skip
            return None
        with self._lock:
            self._sizes[name] = slab.size_bytes
        return part

    def _part(
        self, name: str, slab: Slab, refused: str, layout: Layout, policy: str, start: float
    ) -> DiskPart:
        if refused:
            log.warning("event=disk_slab_not_adopted pool=%s path=%s reason=%s", name,
                        slab.path, refused)  # fmt: skip
        n = slab.num_blocks
        index = BlockIndex(n, policy, layout.block_tokens, medium=MEDIUM, locality=LOCALITY)
        index.slot_sink = slab.table
        part = DiskPart(name, slab, OwnedIndex(index, max(1, n // 2)))
        if not slab.created:
            slots, keys, bad, slot_of = slab.table.ready_map()
            if keys:
                index.adopt(slots, keys, policy_later=True, slot_of=slot_of)
                part.adopted = len(keys)
            log.info("event=disk_slab_adopted pool=%s path=%s blocks=%d entries_refused=%d "
                     "rows=%d direct=%s seconds=%.3f", name, slab.path, len(keys), bad, n,
                     slab.direct, time.monotonic() - start)  # fmt: skip
        else:
            log.info("event=disk_slab_created pool=%s path=%s rows=%d disk_row_bytes=%d "
                     "bytes=%d direct=%s", name, slab.path, n, slab.disk_row_bytes,
                     slab.size_bytes, slab.direct)  # fmt: skip
        return part

    def forget(self, name: str) -> None:
        with self._lock:
            self._sizes.pop(name, None)

    @property
    def bytes_reserved(self) -> int:
        with self._lock:
            return sum(self._sizes.values())


def _rows_in(nbytes: int, disk_row_bytes: int) -> int:
    """Rows a slab of `nbytes` holds: each row, its 80-byte entry and its 4-byte
    checksum; the slab's header page, the entry table's header (a layout of
    up to 16 KiB) and two pages of rounding."""
    return max(0, (nbytes - ALIGN - (16 << 10) - 2 * max(PAGE, ALIGN)) // (disk_row_bytes + 84))


def _half_free(disk_dir: str) -> int:
    """disk_bytes = 0: half of what disk_dir's filesystem has free, counting the
    slabs already there as free (so that the size is the same at every start);
    0 (no disk tier) if the directory cannot be made or read."""
    try:
        os.makedirs(disk_dir, exist_ok=True)
        st = os.statvfs(disk_dir)
        ours = sum(p.stat().st_size for p in Path(disk_dir).iterdir()
                   if p.suffix in (".slab", ".entries") and p.is_file())  # fmt: skip
    except OSError as exc:
        log.error("event=disk_dir_unusable dir=%s reason=%s", disk_dir, exc)
        return 0
    return (st.f_bavail * st.f_frsize + ours) // 2
