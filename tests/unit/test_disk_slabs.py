"""Runs in the test process: each pool's share of the disk tier, and a slab kept across starts."""

from __future__ import annotations

import os
from pathlib import Path

from kvd.config import load_config
from kvd.control.disk_slabs import DiskSlabs, _half_free
from kvd_client.geometry import Geometry
from kvd_client.protocol import Layout

LAYOUT = Layout("m", "bfloat16", 16, 1, False, 8192)
MiB = 1 << 20


def geometry(capacity: int) -> Geometry:
    return Geometry.plan(slot_bytes=8192, world_size=1, replicated=False, capacity_bytes=capacity)


def slabs(where: Path, **keys: object) -> DiskSlabs:
    cfg = load_config(None, {"disk_dir": str(where), "max_total_bytes": 64 * MiB, **keys}, env={})
    return DiskSlabs(cfg, adopt=True)


def test_a_pools_share_is_disk_bytes_times_its_ram_over_max_total(tmp_path: Path) -> None:
    s = slabs(tmp_path, disk_bytes=640 * MiB)
    assert s.share("a", 4 * MiB) == 40 * MiB
    part = s.open("a", LAYOUT, geometry(4 * MiB), "lru")
    assert part is not None
    assert part.slab.size_bytes <= 40 * MiB and part.slab.num_blocks > 40 * MiB // 8192 * 0.95
    part.slab.close()


def test_a_slab_survives_a_start_whose_share_is_smaller_only_when_it_fits(tmp_path: Path) -> None:
    """disk_bytes or the pool's RAM shrank: the old slab is kept while it is at
    most a tenth over the new share; else it is made again at the new size."""
    first = slabs(tmp_path, disk_bytes=640 * MiB).open("a", LAYOUT, geometry(4 * MiB), "lru")
    assert first is not None
    rows = first.slab.num_blocks
    first.slab.close()
    kept = slabs(tmp_path, disk_bytes=600 * MiB).open("a", LAYOUT, geometry(4 * MiB), "lru")
    assert kept is not None and not kept.slab.created and kept.slab.num_blocks == rows
    kept.slab.close()
    smaller = slabs(tmp_path, disk_bytes=640 * MiB).open("a", LAYOUT, geometry(2 * MiB), "lru")
    assert smaller is not None and smaller.slab.created and smaller.slab.num_blocks < rows
    smaller.slab.close()


def test_disk_bytes_zero_counts_the_slabs_already_there_as_free(tmp_path: Path) -> None:
    before = _half_free(str(tmp_path))
    with open(tmp_path / "a.slab", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 64 * MiB)
    (tmp_path / "other.file").write_bytes(b"x" * 4096)
    after = _half_free(str(tmp_path))
    # The slab's 64 MiB count as free; other files do not (the filesystem's
    # free space also moves with other jobs: a MiB of slack).
    assert abs(after - before) < 1 * MiB


def test_a_directory_that_cannot_be_made_leaves_no_disk_tier(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    s = slabs(blocker / "disk")  # a directory under a file
    assert s.total == 0
    assert s.open("a", LAYOUT, geometry(4 * MiB), "lru") is None
