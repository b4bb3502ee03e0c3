"""Runs in the daemon: the pools of this host, each a segment plus an owned index.

The first `Attach` with a new name creates a pool (or it is declared in the
config); later attaches must present an equal `Layout`. Pools outlive the
engines attached to them until `kvd pool drop NAME`, and with `restart =
"warm"` the daemon too: `adopt` takes back the segments an earlier run left,
with their ready blocks (SPEC section 13), and `close(keep=True)` leaves them.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from kvd.config import Config
from kvd.control.disk_slabs import DiskPart, DiskSlabs
from kvd.control.pool import DEAD_RUN, Pool
from kvd.control.pool_builds import Planned, PoolBuilds, build, make_table
from kvd.control.write_behind import ReadyTap
from kvd.core.index import BlockIndex
from kvd.core.ownership import OwnedIndex
from kvd.errors import BadRequest, LayoutMismatch, NoSuchPool, TooLarge
from kvd.io.ready_table import ReadyTableWriter
from kvd.io.region import Manifest, SharedRegion, unlink_segment
from kvd.io.remote_value import layout_fingerprint
from kvd_client.geometry import Geometry
from kvd_client.protocol import Layout
from kvd_client.segment import BadSegment, SegmentHeader

_layout_encoder = msgspec.msgpack.Encoder()
_layout_decoder = msgspec.msgpack.Decoder(Layout)

log = logging.getLogger("kvd.control.pools")

__all__ = ["Found", "Pool", "PoolRegistry"]


@dataclass(frozen=True)
class Found:
    """A segment of an earlier run that a warm start may adopt."""

    shm: str
    header: SegmentHeader
    layout: Layout


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
        self.refused: list[str] = []  # pools whose segments a warm start refused
        # The disk tier's slabs (SPEC 16): a warm start adopts them, a cold one empties them.
        self.disk = DiskSlabs(config, adopt=config.restart == "warm") if config.disk_dir else None
        # New pools' indexes, ready tables and slabs, built off the loop (`plan`,
        # then `builds.start`); the server sets `builds.post`.
        self.builds = PoolBuilds(self._install, tables=config.ready_tables, gid=gid,
                                 manifest=manifest, disk=self.disk)  # fmt: skip

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
        """Shared memory the pools hold: their segments and their ready tables,
        those of the pools being built too."""
        return sum(
            p.region.size + (p.table.nbytes if p.table is not None else 0)
            for p in self._pools.values()
        ) + sum(b.region.size + b.table_bytes for b in self.builds)

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
        """Creates a pool at once, on the caller's thread (the config's pools, at start)."""
        planned = self.plan(name, layout, capacity_bytes, policy)
        build(planned, tables=self.config.ready_tables, gid=self._gid, manifest=self._manifest,
              disk=self.disk)  # fmt: skip
        if planned.error is not None:
            PoolBuilds.discard(planned)
            raise planned.error
        return self._install(planned)

    def plan(self, name: str, layout: Layout, capacity_bytes: int | None, policy: str) -> Planned:
        """A new pool's checks, geometry and segment (cheap: on the loop); `TooLarge`
        or `BadRequest` when it cannot be made. Its index and ready table come
        from `pool_builds.build`, its `Pool` from `_install`."""
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

        def plan(capacity: int) -> Geometry:
            return Geometry.plan(slot_bytes=layout.slot_bytes, world_size=layout.world_size,
                                 replicated=layout.replicated, capacity_bytes=capacity)  # fmt: skip

        geometry = plan(min(wanted, room))
        generation = time.time_ns() // 1000
        header = self._header(name, layout, geometry, generation, policy)
        if header.size_bytes > room:
            if capacity_bytes is not None:
                raise TooLarge(
                    f"pool {name!r} needs {header.size_bytes} bytes with its slot table; "
                    f"{room} of max_total_bytes {self.config.max_total_bytes} are left"
                )
            # The default size: fewer blocks, so that the rows and the table fit.
            geometry = plan(room - (header.size_bytes - geometry.size_bytes))
            header = self._header(name, layout, geometry, generation, policy)
        region = None
        for _ in range(16):
            try:
                region = SharedRegion(
                    f"/kvd.{name}.{generation}",
                    header,
                    gid=self._gid,
                    prefault=self.config.prefault,
                    manifest=self._manifest,
                    reserved=sum(
                        p.region.size
                        for p in [*self._pools.values(), *self.builds]
                        if p.region.prefaulting
                    ),
                )
                break
            except FileExistsError:
                generation += 1
                header = self._header(name, layout, geometry, generation, policy)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise TooLarge(f"pool {name!r}: {exc.strerror}") from None
        if region is None:
            raise TooLarge(f"cannot create a segment for pool {name!r}: names in use")
        return Planned(name, layout, geometry, generation, region, policy)

    def _install(self, b: Planned) -> Pool:
        assert b.index is not None
        pool = self._add(b.name, b.layout, b.geometry, b.generation, b.region, b.index, b.policy,
                         b.table, b.disk)  # fmt: skip
        g = b.geometry
        log.info("event=pool_created pool=%s shm=%s blocks=%d row_bytes=%d bytes=%d policy=%s",
                 b.name, b.region.name, g.num_blocks, g.row_bytes, g.size_bytes,
                 b.policy)  # fmt: skip
        return pool

    @staticmethod
    def _header(
        name: str, layout: Layout, g: Geometry, generation: int, policy: str
    ) -> SegmentHeader:
        return SegmentHeader(
            generation, g.num_blocks, g.row_bytes, g.slot_bytes, g.num_slots, g.slot_stride,
            g.replicated, name, _layout_encoder.encode(layout), policy,
        )  # fmt: skip

    def _add(
        self,
        name: str,
        layout: Layout,
        geometry: Geometry,
        generation: int,
        region: SharedRegion,
        index: BlockIndex,
        policy: str,
        table: ReadyTableWriter | None,
        disk: DiskPart | None = None,
    ) -> Pool:
        pin_cap = max(1, int(geometry.num_blocks * self.config.pin_cap_fraction))
        index.sink = table
        index.slot_sink = region.table
        pool = Pool(
            name, layout, geometry, generation, region, OwnedIndex(index, pin_cap), policy, table
        )
        if self.config.remote_url or disk is not None:  # tiers below: they see what is ready
            pool.tap = ReadyTap(region.table)
            index.slot_sink = pool.tap
            pool.fingerprint = layout_fingerprint(layout, geometry)
        pool.disk = disk
        self._pools[name] = pool
        return pool

    def check_segments(self, names: list[str]) -> list[Found]:
        """The pool segments of an earlier run among `names` (the manifest's) that
        this daemon may adopt (SPEC 13). Each one refused is named in `refused`
        with one log line; the caller unlinks it. A pool declared in the config
        must match its segment's layout and size."""
        declared = {pc.name: pc for pc in self.config.pools}
        found: dict[str, Found] = {}

        def refuse(shm: str, pool: str, reason: str) -> None:
            log.warning("event=pool_not_adopted pool=%s shm=%s reason=%s", pool, shm, reason)
            self.refused.append(pool)

        for shm in names:
            if shm.endswith(".ready") or not shm.startswith("/kvd."):
                continue
            pool_name = shm[len("/kvd.") :].rpartition(".")[0] or shm
            try:
                header = SharedRegion.adopt(shm, self._gid)
                if header.name != pool_name or f"/kvd.{header.name}.{header.generation}" != shm:
                    raise BadSegment(f"header names pool {header.name!r} gen {header.generation}")
                try:
                    layout = _layout_decoder.decode(header.layout)
                    _check_layout(layout)
                except (msgspec.DecodeError, msgspec.ValidationError, BadRequest) as exc:
                    raise BadSegment(f"layout in header: {exc}") from None
                planned = Geometry.plan(
                    slot_bytes=layout.slot_bytes,
                    world_size=layout.world_size,
                    replicated=layout.replicated,
                    capacity_bytes=header.num_blocks * header.row_bytes,
                )
                if (planned.num_blocks, planned.row_bytes, planned.slot_stride) != (
                    header.num_blocks, header.row_bytes, header.slot_stride,
                ):  # fmt: skip
                    raise BadSegment("header geometry does not follow from its layout")
                pc = declared.get(pool_name)
                if pc is not None:
                    want = Layout(pc.model, pc.dtype, pc.block_tokens, pc.world_size,
                                  pc.replicated, pc.slot_bytes, pc.extra)  # fmt: skip
                    size = pc.capacity_bytes // header.row_bytes
                    if want != layout or size != header.num_blocks:
                        raise BadSegment(
                            "the config declares this pool with another layout or size"
                        )
            except BadSegment as exc:
                refuse(shm, pool_name, str(exc))
                continue
            held = found.get(pool_name)
            if held is not None:  # two generations of one pool: the newer one stays
                older, newer = sorted([held, Found(shm, header, layout)],
                                      key=lambda f: f.header.generation)  # fmt: skip
                refuse(older.shm, pool_name, "a newer generation of the pool is here")
                found[pool_name] = newer
            else:
                found[pool_name] = Found(shm, header, layout)
        kept: list[Found] = []
        total = 0
        for f in found.values():
            if total + f.header.size_bytes > self.config.max_total_bytes:
                refuse(f.shm, f.header.name, "its size is above what max_total_bytes leaves")
                continue
            total += f.header.size_bytes
            kept.append(f)
        return kept

    def adopt(self, checked: list[Found]) -> list[Pool]:
        """Takes back the segments `check_segments` kept, each with its ready blocks."""
        declared = {pc.name: pc for pc in self.config.pools}
        adopted = []
        for f in checked:
            try:
                shm, header, layout, pool_name = f.shm, f.header, f.layout, f.header.name
                start = time.monotonic()
                region = SharedRegion(
                    shm,
                    header,
                    gid=self._gid,
                    prefault=self.config.prefault,
                    manifest=self._manifest,
                    adopted=True,
                )
                slots, keys, bad, slot_of = region.table.ready_map()
                storing, pinned = region.table.in_use()
                scanned = time.monotonic()
                h = header
                geometry = Geometry(h.num_blocks, h.row_bytes, h.slot_bytes, h.num_slots,
                                    h.slot_stride, h.replicated)  # fmt: skip
                policy = declared[pool_name].policy if pool_name in declared else None
                policy = policy or self.config.policy
                index = BlockIndex(geometry.num_blocks, policy, layout.block_tokens)
                table = None
                if self.config.ready_tables:
                    table = make_table(region, geometry.num_blocks, header.generation,
                                       gid=self._gid, manifest=self._manifest)  # fmt: skip
                disk = self.disk.open(pool_name, layout, geometry, policy) if self.disk else None
                try:
                    pool = self._add(pool_name, layout, geometry, header.generation, region,
                                     index, policy, table, disk)  # fmt: skip
                except BaseException:
                    if disk is not None and self.disk is not None:  # not left open and locked
                        disk.slab.close()
                        self.disk.forget(pool_name)
                    raise
                index.adopt(slots, keys, policy_later=True, slot_of=slot_of, held=storing)
                # Jobs of the dead daemon were made before now: their hard deadlines
                # (two job timeouts after they were made) are all behind this one.
                # Until then, the slots its store jobs may write stay held and the
                # blocks its load jobs may read stay pinned; every other slot
                # serves stores at once.
                # A vLLM worker may start a copy of the dead daemon's slots up to a
                # lease after its last answer (SPEC 12): two leases cover that too.
                hold_s = 2 * max(self.config.job_timeout_ms, self.config.lease_ms) / 1000
                pool.held_until = time.monotonic() + hold_s
                pinned_keys = [k for k in map(index.key_at, pinned) if k is not None]
                pool.owned.hold_pins(DEAD_RUN, pinned_keys, pool.held_until)
                adopted.append(pool)
                log.info(
                    "event=pool_adopted pool=%s shm=%s blocks_ready=%d entries_refused=%d "
                    "blocks=%d seconds=%.3f scan_seconds=%.3f slots_held=%d blocks_pinned=%d "
                    "held_s=%.1f",
                    pool_name, shm, len(keys), bad, geometry.num_blocks, time.monotonic() - start,
                    scanned - start, len(storing), len(pinned_keys), hold_s,
                )  # fmt: skip
            except Exception as exc:  # one pool that cannot be taken back starts cold
                log.warning("event=pool_not_adopted pool=%s shm=%s reason=%s",
                            pool_name, shm, f"adoption failed: {exc!r}")  # fmt: skip
                self.refused.append(pool_name)
                if pool_name in self._pools:
                    self.drop(pool_name)
                else:
                    unlink_segment(shm, self._manifest)
        return adopted

    def slab_started_empty(self, name: str) -> bool:
        """Whether the pool's slab was made empty at this start (not adopted): an
        earlier run's blocks on disk are gone, which event consumers must hear."""
        pool = self._pools.get(name)
        return pool is not None and pool.disk is not None and pool.disk.slab.created

    def drop(self, name: str, *, disk: bool = False) -> Pool:
        """Drops the pool and its segment; its slab is deleted with `disk` (an
        operator's drop, a cold shutdown), else kept for the pool's next run."""
        pool = self.get(name)
        del self._pools[name]
        if pool.table is not None:
            pool.table.close()
        pool.region.close()
        if pool.disk is not None and self.disk is not None:
            pool.disk.slab.remove() if disk else pool.disk.slab.close()
            self.disk.forget(name)
        log.info("event=pool_dropped pool=%s shm=%s", name, pool.region.name)
        return pool

    def close(self, keep: bool = False) -> None:
        """Drops every pool, or with `keep` (a warm daemon's shutdown) unmaps each
        and leaves its segment, with its ready blocks, to the next run. A pool still
        being built goes (its Attach was never answered)."""
        self.builds.close()
        for name in list(self._pools):
            if not keep:
                self.drop(name, disk=True)
                continue
            pool = self._pools.pop(name)
            if pool.table is not None:
                pool.table.close()  # the ready table is rebuilt at the next start
            if pool.disk is not None:
                pool.disk.slab.close()
            pool.region.release()
            log.info("event=pool_kept pool=%s shm=%s blocks_ready=%d",
                     name, pool.region.name, pool.index.num_ready)  # fmt: skip
