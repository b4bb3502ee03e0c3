"""Runs in the daemon: one pool, a segment plus an owned index, as the registry holds it.

`kvd.control.pools.PoolRegistry` creates, adopts and drops pools; a `Pool` is
what the handlers of the control socket read and change.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.control.disk_slabs import DiskPart
from kvd.control.write_behind import ReadyTap
from kvd.core.index import BlockIndex
from kvd.core.ownership import OwnedIndex
from kvd.io.ready_table import ReadyTableWriter
from kvd.io.region import SharedRegion
from kvd_client.geometry import Geometry
from kvd_client.protocol import Attached, Layout, PoolInfo

# The owner of the blocks a load job of the dead daemon may still read (SPEC 13).
DEAD_RUN = ("dead-run", 0)


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
    # Adopted warm: until this (monotonic), the slots a job of the dead daemon
    # may still touch are held back (`BlockIndex.release_held`, SPEC 13).
    held_until: float = 0.0
    # With a remote tier (SPEC 14): the blocks that became ready, for the
    # write-behind, and the name the pool's blocks have there.
    tap: ReadyTap | None = None
    fingerprint: str = ""
    disk: DiskPart | None = None  # its slab and disk index (SPEC 16), with a disk tier

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
            self.region.header.data_offset,
            self.tap is not None,  # a tier below RAM: a short lookup asks the daemon
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
            blocks_held=ix.num_held,
            disk_blocks=self.disk.index.num_ready if self.disk is not None else 0,
            disk_capacity_blocks=self.disk.slab.num_blocks if self.disk is not None else 0,
        )
