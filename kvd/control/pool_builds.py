"""Runs in the daemon: a new pool's index and ready table, built on a thread of their own.

A pool of 4M blocks takes a second or two to make (its `BlockIndex`, with the
adaptive policy's arrays, and the ready table's `posix_fallocate` of 576
MiB): on the loop, that held every other session's requests (557 ms on the
machine of the review that found it, 2 s here). So the first `Attach` of a
pool plans it on the loop (checks, geometry, room, its segment: cheap, and a
pool that cannot be made is refused at once), and `PoolBuilds` builds the
rest on a thread while the loop goes on serving; the Attach, and any other
Attach of the same pool meanwhile, is answered once the pool is installed,
on the loop (`post`, the loop's call_soon_threadsafe).

The thread holds the GIL in pieces (an array of a few tens of MiB at a
time), so the loop waits for it a few milliseconds at most; the ready
table's allocation releases it. Nothing of the pool is shared before it is
installed: the thread only makes objects, and the manifest it writes the
table's name to takes a lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.core.index import BlockIndex
from kvd.errors import KvdError, LayoutMismatch
from kvd.io.ready_table import ReadyTableWriter
from kvd.io.region import Manifest, SharedRegion
from kvd_client.errors import ErrorCode
from kvd_client.geometry import Geometry
from kvd_client.protocol import Layout
from kvd_client.ready_table import table_name

if TYPE_CHECKING:
    from kvd.control.disk_slabs import DiskPart, DiskSlabs
    from kvd.control.pool import Pool

log = logging.getLogger("kvd.control.pool_builds")

Done = Callable[[KvdError | None], None]  # a pool built (None) or not (why), on the loop


@dataclass(eq=False)
class Planned:
    """A pool whose segment exists, and what its thread builds for it."""

    name: str
    layout: Layout
    geometry: Geometry
    generation: int
    region: SharedRegion
    policy: str
    table: ReadyTableWriter | None = None
    index: BlockIndex | None = None
    error: BaseException | None = None
    disk: DiskPart | None = None  # its slab, with a disk tier (SPEC 16)
    done: list[Done] = field(default_factory=list)
    thread: threading.Thread | None = None

    @property
    def table_bytes(self) -> int:
        """What the ready table will hold of shared memory, counted before it exists."""
        return ReadyTableWriter.size_for(self.geometry.num_blocks)


def make_table(
    region: SharedRegion, num_blocks: int, generation: int, *, gid: int | None, manifest: Manifest
) -> ReadyTableWriter | None:
    """The pool's ready table, or None (no room: lookups then take the round trip,
    and the log says why)."""
    name = table_name(region.name)
    try:
        return ReadyTableWriter(name, num_blocks, generation, gid=gid, manifest=manifest)
    except OSError as exc:
        log.warning("event=ready_table_failed shm=%s error=%s", name, exc)
        return None


def build(
    planned: Planned,
    *,
    tables: bool,
    gid: int | None,
    manifest: Manifest,
    disk: DiskSlabs | None = None,
) -> None:
    """Makes the planned pool's ready table (if `tables`), index and disk part (its
    slab, adopted or new, with a disk tier); any error is kept."""
    g = planned.geometry
    try:
        if tables:
            planned.table = make_table(planned.region, g.num_blocks, planned.generation,
                                       gid=gid, manifest=manifest)  # fmt: skip
        planned.index = BlockIndex(g.num_blocks, planned.policy, planned.layout.block_tokens)
        if disk is not None:  # never raises: a slab that fails leaves the pool without one
            planned.disk = disk.open(planned.name, planned.layout, g, planned.policy)
    except BaseException as exc:  # handed to the loop, which answers the Attach with it
        planned.error = exc


class PoolBuilds:
    """The pools being built, by name; `install` makes each a `Pool` on the loop."""

    def __init__(
        self,
        install: Callable[[Planned], Pool],
        *,
        tables: bool,
        gid: int | None,
        manifest: Manifest,
        disk: DiskSlabs | None = None,
    ) -> None:
        self._install = install
        self._tables, self._gid, self._manifest = tables, gid, manifest
        self._disk = disk
        self._building: dict[str, Planned] = {}
        self.post: Callable[[Callable[[], None]], object] | None = None  # set by the server

    def __iter__(self) -> Iterator[Planned]:
        return iter(list(self._building.values()))

    def find(self, name: str) -> Planned | None:
        return self._building.get(name)

    def join(self, name: str, layout: Layout, done: Done) -> bool:
        """Waits (`done`) for the pool called `name` if it is being built; False if not."""
        planned = self._building.get(name)
        if planned is None:
            return False
        if planned.layout != layout:
            raise LayoutMismatch(
                f"pool {name!r} holds layout {planned.layout}; this engine presents {layout}"
            )
        planned.done.append(done)
        return True

    def start(self, planned: Planned, done: Done) -> None:
        """Builds `planned` on a thread of its own; `done` runs on the loop after."""
        post = self.post
        assert post is not None
        planned.done.append(done)
        self._building[planned.name] = planned

        def run() -> None:
            build(planned, tables=self._tables, gid=self._gid, manifest=self._manifest,
                  disk=self._disk)  # fmt: skip
            with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon exits
                post(lambda: self._finish(planned))

        planned.thread = threading.Thread(target=run, name=f"kvd-build-{planned.name}", daemon=True)
        planned.thread.start()

    def _finish(self, planned: Planned) -> None:
        """On the loop: installs the built pool, or drops it; then its waiters."""
        if self._building.get(planned.name) is not planned:
            return  # closed meanwhile (the daemon stops)
        del self._building[planned.name]
        error: KvdError | None = None
        if planned.error is None:
            self._install(planned)
        else:
            exc = planned.error
            error = exc if isinstance(exc, KvdError) else KvdError(
                f"pool {planned.name!r} could not be built: {exc!r}", ErrorCode.INTERNAL
            )  # fmt: skip
            log.error("event=pool_build_failed pool=%s reason=%r", planned.name, exc)
            self.discard(planned)
        for done in planned.done:
            done(error)

    @staticmethod
    def discard(planned: Planned) -> None:
        """Frees what a build made (its table, its segment, its slab's descriptor)."""
        if planned.table is not None:
            planned.table.close()
        if planned.disk is not None:
            planned.disk.slab.close()
        planned.region.close()

    def close(self) -> None:
        """The daemon stops: waits for the builds still running and frees them."""
        for planned in list(self._building.values()):
            if planned.thread is not None:
                planned.thread.join()
            self.discard(planned)
        self._building.clear()
