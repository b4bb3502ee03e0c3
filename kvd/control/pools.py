"""Runs in the daemon: the pools of this host, each a segment plus an owned index.

The first `Attach` with a new name creates a pool (or it is declared in the
config); later attaches must present an equal `Layout`. Pools outlive the
engines attached to them until `kvd pool drop NAME` or daemon shutdown.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvd.config import Config
from kvd.core.index import BlockIndex
from kvd.core.ownership import OwnedIndex
from kvd.errors import BadRequest, LayoutMismatch, NoSuchPool, TooLarge
from kvd.io.ready_table import ReadyTableWriter
from kvd.io.region import Manifest, SharedRegion
from kvd_client.geometry import Geometry
from kvd_client.protocol import Attached, Layout, PoolInfo
from kvd_client.ready_table import table_name

log = logging.getLogger("kvd.control.pools")


@dataclass
class Pool:
    name: str
    layout: Layout
    geometry: Geometry
    generation: int
    region: SharedRegion
    owned: OwnedIndex
    policy: str
    table: ReadyTableWriter | None = None  # the ready set in shared memory (SPEC 15)
    sessions: int = 0
    resetting: bool = False  # a Reset waits for the pool's copies to end

    @property
    def index(self) -> BlockIndex:
        return self.owned.index

    def attached(self, req_id: int) -> Attached:
        g = self.geometry
        return Attached(
            req_id,
            self.region.name,
            self.generation,
            g.num_blocks,
            g.row_bytes,
            g.slot_bytes,
            g.num_slots,
            g.slot_stride,
            self.table.name if self.table is not None else "",
        )

    def info(self) -> PoolInfo:
        ix = self.index
        return PoolInfo(
            name=self.name,
            shm_name=self.region.name,
            generation=self.generation,
            layout=self.layout,
            policy=self.policy,
            num_blocks=ix.num_blocks,
            row_bytes=self.geometry.row_bytes,
            capacity_bytes=self.geometry.size_bytes,
            blocks_ready=ix.num_ready,
            blocks_in_flight=ix.num_in_flight,
            blocks_pinned=ix.num_pinned,
            blocks_free=ix.num_free,
            sessions=self.sessions,
        )


def _check_layout(layout: Layout) -> None:
    if layout.block_tokens < 1 or layout.world_size < 1 or layout.slot_bytes < 1:
        raise BadRequest("layout: block_tokens, world_size and slot_bytes must be >= 1")
    if layout.world_size > 1024:
        raise BadRequest(f"layout: world_size {layout.world_size} is above 1024")


class PoolRegistry:
    def __init__(self, config: Config, manifest: Manifest, gid: int | None) -> None:
        self.config = config
        self._manifest = manifest
        self._gid = gid
        self._pools: dict[str, Pool] = {}

    def __iter__(self) -> Iterator[Pool]:
        return iter(list(self._pools.values()))

    def __len__(self) -> int:
        return len(self._pools)

    def get(self, name: str) -> Pool:
        try:
            return self._pools[name]
        except KeyError:
            raise NoSuchPool(f"no pool named {name!r}") from None

    def find(self, name: str) -> Pool | None:
        return self._pools.get(name)

    @property
    def used_bytes(self) -> int:
        """Shared memory the pools hold: their segments and their ready tables."""
        return sum(
            p.geometry.size_bytes + (p.table.nbytes if p.table is not None else 0)
            for p in self._pools.values()
        )

    def attach(self, name: str, layout: Layout, capacity_bytes: int | None) -> Pool:
        """The pool called `name`, created on first use; `LayoutMismatch` if it differs."""
        pool = self._pools.get(name)
        if pool is not None:
            if pool.layout != layout:
                raise LayoutMismatch(
                    f"pool {name!r} holds layout {pool.layout}; this engine presents {layout}"
                )
            return pool
        return self.create(name, layout, capacity_bytes, self.config.policy)

    def create(self, name: str, layout: Layout, capacity_bytes: int | None, policy: str) -> Pool:
        _check_layout(layout)
        room = self.config.max_total_bytes - self.used_bytes
        wanted = capacity_bytes if capacity_bytes is not None else self.config.default_pool_bytes
        if wanted < 1:
            raise BadRequest(f"capacity_bytes must be >= 1, got {wanted}")
        if capacity_bytes is not None and capacity_bytes > room:
            raise TooLarge(
                f"pool {name!r} asks {capacity_bytes} bytes; {room} of max_total_bytes "
                f"{self.config.max_total_bytes} are left"
            )
        geometry = Geometry.plan(
            slot_bytes=layout.slot_bytes,
            world_size=layout.world_size,
            replicated=layout.replicated,
            capacity_bytes=min(wanted, room),
        )
        generation = time.time_ns() // 1000
        region = None
        for _ in range(16):
            try:
                region = SharedRegion(
                    f"/kvd.{name}.{generation}",
                    geometry.size_bytes,
                    gid=self._gid,
                    prefault=self.config.prefault,
                    manifest=self._manifest,
                    reserved=sum(
                        p.geometry.size_bytes for p in self._pools.values() if p.region.prefaulting
                    ),
                )
                break
            except FileExistsError:
                generation += 1
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise TooLarge(f"pool {name!r}: {exc.strerror}") from None
        if region is None:
            raise TooLarge(f"cannot create a segment for pool {name!r}: names in use")
        pin_cap = max(1, int(geometry.num_blocks * self.config.pin_cap_fraction))
        index = BlockIndex(geometry.num_blocks, policy, layout.block_tokens)
        table = self._table(region, geometry.num_blocks, generation)
        index.sink = table
        pool = Pool(
            name, layout, geometry, generation, region, OwnedIndex(index, pin_cap), policy, table
        )
        self._pools[name] = pool
        log.info(
            "event=pool_created pool=%s shm=%s blocks=%d row_bytes=%d bytes=%d policy=%s",
            name,
            region.name,
            geometry.num_blocks,
            geometry.row_bytes,
            geometry.size_bytes,
            policy,
        )
        return pool

    def _table(
        self, region: SharedRegion, num_blocks: int, generation: int
    ) -> ReadyTableWriter | None:
        """The pool's ready table, or None (configured off, or no room: lookups
        then take the round trip, and the log says why)."""
        if not self.config.ready_tables:
            return None
        name = table_name(region.name)
        try:
            return ReadyTableWriter(name, num_blocks, generation, gid=self._gid,
                                    manifest=self._manifest)  # fmt: skip
        except OSError as exc:
            log.warning("event=ready_table_failed shm=%s error=%s", name, exc)
            return None

    def drop(self, name: str) -> Pool:
        pool = self.get(name)
        del self._pools[name]
        if pool.table is not None:
            pool.table.close()
        pool.region.close()
        log.info("event=pool_dropped pool=%s shm=%s", name, pool.region.name)
        return pool

    def close(self) -> None:
        for name in list(self._pools):
            self.drop(name)
