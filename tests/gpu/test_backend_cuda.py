"""The CUDA transfer backend: round trips through a registered pool, stream ordering,
and clean failures. Skipped without a CUDA device."""

from __future__ import annotations

import mmap
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvd_client.backends import CopyJob, CopyResult, make_backend
from kvd_client.geometry import Geometry

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KiB = 1 << 10
MiB = 1 << 20


@pytest.fixture
def regions() -> Iterator[list[mmap.mmap]]:
    made: list[mmap.mmap] = []
    yield made
    for region in made:
        region.close()  # fails if a backend left a view of it behind


def geometry_for(
    slot_bytes: int, num_blocks: int, world: int = 1, replicated: bool = False
) -> Geometry:
    row = Geometry.plan(
        slot_bytes=slot_bytes, world_size=world, replicated=replicated, capacity_bytes=1 << 40
    ).row_bytes
    return Geometry.plan(
        slot_bytes=slot_bytes,
        world_size=world,
        replicated=replicated,
        capacity_bytes=num_blocks * row,
    )


def random_pages(num_blocks: int, page_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks, page_bytes), dtype=torch.uint8, generator=gen)
    return raw.view(torch.bfloat16).cuda()


def one(results: list[CopyResult]) -> CopyResult:
    assert len(results) == 1
    return results[0]


def round_trip(
    backend: Any, layers: list[torch.Tensor], device: list[int], pooled: list[int]
) -> None:
    original = [t.clone() for t in layers]
    backend.submit(CopyJob(1, "store", device, pooled))
    result = one(backend.wait([1]))
    assert result.ok, result.error
    for t in layers:
        t.zero_()
    backend.submit(CopyJob(2, "load", device, pooled))
    result = one(backend.wait([2]))
    assert result.ok, result.error
    torch.cuda.synchronize()
    moved = torch.zeros(len(layers[0]), dtype=torch.bool, device=layers[0].device)
    moved[device] = True
    for t, o in zip(layers, original, strict=True):
        assert torch.equal(t[moved].view(torch.uint8), o[moved].view(torch.uint8))
        assert not t[~moved].view(torch.uint8).any()


@pytest.mark.parametrize("staging_bytes", [64 * MiB, 40 * KiB])  # one chunk, many chunks
@pytest.mark.parametrize("page", [16 * KiB, 2 * MiB])
def test_contiguous_round_trip(regions: list[mmap.mmap], page: int, staging_bytes: int) -> None:
    n = 4 if page >= 2 * MiB else 40
    geometry = geometry_for(page, 3 * n)
    region = mmap.mmap(-1, geometry.size_bytes)
    regions.append(region)
    kv = random_pages(3 * n, page, seed=page)
    rnd = random.Random(0)
    device = rnd.sample(range(3 * n), n)
    pooled = list(range(5, 5 + n // 2)) + rnd.sample(range(5 + n // 2, 3 * n), n - n // 2)
    with make_backend("cuda", kv, region, geometry, 0) as backend:
        round_trip(backend, [kv], device, pooled)


@pytest.mark.parametrize(("world", "rank"), [(1, 0), (4, 2)])
def test_per_layer_round_trip(regions: list[mmap.mmap], world: int, rank: int) -> None:
    layers, page, n = 8, 2 * KiB, 30
    geometry = geometry_for(layers * page, 2 * n, world=world)
    region = mmap.mmap(-1, geometry.size_bytes)
    regions.append(region)
    kv = [random_pages(2 * n, page, seed=i) for i in range(layers)]
    rnd = random.Random(1)
    device, pooled = rnd.sample(range(2 * n), n), rnd.sample(range(2 * n), n)
    with make_backend(None, kv, region, geometry, rank) as backend:
        round_trip(backend, kv, device, pooled)
    # Only this rank's slots were written.
    host = torch.frombuffer(region, dtype=torch.uint8)
    for p in range(geometry.num_blocks):
        for other in range(world):
            if other != rank or p not in pooled:
                start = geometry.slot_offset(p, other)
                assert not host[start : start + geometry.slot_bytes].any()
    del host


def test_store_waits_for_the_compute_stream(regions: list[mmap.mmap]) -> None:
    geometry = geometry_for(1 * MiB, 8)
    region = mmap.mmap(-1, geometry.size_bytes)
    regions.append(region)
    kv = torch.zeros(8, MiB // 4, dtype=torch.float32, device="cuda")
    with make_backend("cuda", kv, region, geometry, 0) as backend:
        # A slow "forward pass" queued on the current stream, then the value it leaves.
        big = torch.rand(4096, 4096, device="cuda")
        for _ in range(20):
            big = big @ big / 4096
        kv.fill_(7.0)
        backend.submit(CopyJob(1, "store", list(range(8)), list(range(8))))
        assert one(backend.wait([1])).ok
    host = torch.frombuffer(region, dtype=torch.float32)
    assert bool((host == 7.0).all())
    del host


def test_replicated_non_writer_copies_nothing(regions: list[mmap.mmap]) -> None:
    geometry = geometry_for(16 * KiB, 4, world=2, replicated=True)
    region = mmap.mmap(-1, geometry.size_bytes)
    regions.append(region)
    kv = random_pages(4, 16 * KiB, seed=3)
    with make_backend("cuda", kv, region, geometry, 1) as backend:
        backend.submit(CopyJob(1, "store", [0, 1], [2, 3], writer=False))
        result = one(backend.poll())
        assert (result.ok, result.nbytes) == (True, 0)
    assert not any(region[:])


def test_bad_ids_fail_without_copying(regions: list[mmap.mmap]) -> None:
    geometry = geometry_for(16 * KiB, 4)
    region = mmap.mmap(-1, geometry.size_bytes)
    regions.append(region)
    kv = random_pages(4, 16 * KiB, seed=4)
    before = kv.clone()
    with make_backend("cuda", kv, region, geometry, 0) as backend:
        backend.submit(CopyJob(1, "load", [0, 9], [0, 1]))
        result = one(backend.poll())
        assert not result.ok and result.error is not None and "device block id 9" in result.error
        backend.submit(CopyJob(2, "store", [0], [4]))
        assert not one(backend.wait([2])).ok
    assert torch.equal(kv.view(torch.uint8), before.view(torch.uint8))
    assert not any(region[:])


def test_poll_reports_each_job_once(regions: list[mmap.mmap]) -> None:
    geometry = geometry_for(256 * KiB, 16)
    region = mmap.mmap(-1, geometry.size_bytes)
    regions.append(region)
    kv = random_pages(16, 256 * KiB, seed=5)
    with make_backend("cuda", kv, region, geometry, 0) as backend:
        for job_id in range(1, 5):
            backend.submit(CopyJob(job_id, "store", [job_id], [job_id]))
        seen: list[int] = []
        deadline = time.monotonic() + 10
        while len(seen) < 4 and time.monotonic() < deadline:
            seen += [r.job_id for r in backend.poll()]
        assert sorted(seen) == [1, 2, 3, 4]
        assert backend.poll() == [] and backend.wait([1, 2]) == []
