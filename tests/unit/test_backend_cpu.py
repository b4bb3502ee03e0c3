"""The CPU transfer backend: bit-exact round trips through the pool, for every layout,
placement and copy path, and clean failures that copy nothing."""

from __future__ import annotations

import ctypes
import mmap
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvd_client.backends import CopyJob, CopyResult, make_backend
from kvd_client.backends.cpu import CpuBackend
from kvd_client.errors import BadRequest
from kvd_client.geometry import Geometry

KiB = 1 << 10
MiB = 1 << 20

# Backend settings that force each copy path on small data: small jobs take
# the torch paths by default; "native" and "native_threads" force the native
# copier (where it was built), the others the torch paths without it.
TORCH = {"native": False}
PATHS: dict[str, dict[str, Any]] = {
    "default": {},
    "native": {"native_min_bytes": 0},
    "native_threads": {"native_min_bytes": 0, "parallel_min_bytes": 0, "threads": 3},
    "torch": TORCH,
    "direct": {**TORCH, "direct_min_bytes": 1},  # every run one copy_ per layer
    "no_segments": {**TORCH, "segment_min_bytes": 1 << 40},  # scattered jobs go staged
    "tiny_staging": {**TORCH, "segment_min_bytes": 1 << 40, "staging_bytes": 1},
    "pairs": {**TORCH, "segment_min_bytes": 1 << 40, "pair_min_bytes": 1},  # copy_ each
    "no_span": {**TORCH, "layer_span": False},
}


class Pool:
    """An anonymous mapping standing in for the daemon's segment."""

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.mm = mmap.mmap(-1, geometry.size_bytes)
        self.backends: list[CpuBackend] = []

    def backend(self, kv: Any, rank: int = 0, **options: Any) -> CpuBackend:
        backend = CpuBackend(kv, self.mm, self.geometry, rank, **options)
        self.backends.append(backend)
        return backend

    def bytes_at(self, offset: int, length: int) -> bytes:
        return self.mm[offset : offset + length]

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.mm.close()  # raises BufferError if a view of it survived close()


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Correctness, not speed: one torch thread keeps a busy CI machine from
    stalling every parallel copy on a descheduled helper thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pools() -> Iterator[list[Pool]]:
    made: list[Pool] = []
    yield made
    for pool in made:
        pool.close()


def new_pool(
    pools: list[Pool], slot_bytes: int, num_blocks: int, world: int = 1, **kw: Any
) -> Pool:
    stride = Geometry.plan(
        slot_bytes=slot_bytes,
        world_size=world,
        replicated=kw.get("replicated", False),
        capacity_bytes=1 << 40,
    ).row_bytes
    geometry = Geometry.plan(
        slot_bytes=slot_bytes,
        world_size=world,
        replicated=kw.get("replicated", False),
        capacity_bytes=num_blocks * stride,
    )
    pool = Pool(geometry)
    pools.append(pool)
    return pool


def random_pages(num_blocks: int, page_bytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of any dtype (NaN payloads included), shaped [blocks, ..., elems]."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (num_blocks, page_bytes), dtype=torch.uint8, generator=gen)
    typed = raw.view(dtype)
    return typed.view(num_blocks, 2, -1) if typed.shape[1] % 2 == 0 else typed


def as_bytes(t: torch.Tensor) -> bytes:
    flat = t.contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.nbytes)


PATTERNS = ["runs", "permutation", "device_range", "pool_range", "scattered", "mixed"]


def pairs(
    pattern: str, n: int, num_device: int, num_pool: int, seed: int
) -> tuple[list[int], list[int]]:
    """Device and pool ids of one job; the copy path each takes is in the comments."""
    rnd = random.Random(seed)
    if pattern == "runs":  # one copy_ per run (with "direct") or one segment
        return list(range(2, 2 + n)), list(range(1, 1 + n))
    if pattern == "permutation":  # shuffled ranges on both sides: one gather
        return rnd.sample(range(n), n), rnd.sample(range(n), n)
    if pattern == "device_range":  # stores scatter, loads gather
        return rnd.sample(range(1, 1 + n), n), rnd.sample(range(num_pool), n)
    if pattern == "pool_range":  # stores gather, loads scatter
        return rnd.sample(range(num_device), n), rnd.sample(range(2, 2 + n), n)
    if pattern == "scattered":  # random subsets on both sides: staged
        return rnd.sample(range(num_device), n), rnd.sample(range(num_pool), n)
    # mixed: a run, then scattered pairs
    third = n // 3
    device = list(range(third)) + rnd.sample(range(third, num_device), n - third)
    pool = list(range(num_pool - third, num_pool)) + rnd.sample(range(num_pool - third), n - third)
    return device, pool


# No CPU copy moves bytes faster than this: a result claiming more is not a copy.
MAX_BYTES_PER_SECOND = 1e12


def copy_job(
    pool: Pool,
    backend: CpuBackend,
    layers: list[torch.Tensor],
    job: CopyJob,
    rank: int = 0,
    wait: bool = False,
) -> CopyResult:
    """Runs `job` and checks its one result against what the copy did to memory:
    every destination page holds its source's bytes (offsets from SPEC section 3),
    nothing else changed on either side, `nbytes` is the bytes moved, and `seconds`
    is above zero and within the time the call took."""
    geometry = pool.geometry
    region = torch.frombuffer(pool.mm, dtype=torch.uint8)
    try:
        pool_before = region.clone()
        layers_before = [as_rows(t).clone() for t in layers]
        start = time.perf_counter()
        backend.submit(job)
        results = backend.wait([job.job_id]) if wait else backend.poll()
        wall = time.perf_counter() - start
        assert len(results) == 1, results
        (result,) = results
        assert result.job_id == job.job_id
        assert result.ok, result.error
        pairs = list(zip(job.device_block_ids, job.pool_block_ids, strict=True))
        copies = job.kind == "load" or job.writer
        page_bytes = [rows.shape[1] for rows in layers_before]
        assert result.nbytes == (len(pairs) * sum(page_bytes) if copies else 0)  # bytes moved
        assert 0 < result.seconds <= wall, (result.seconds, wall)
        assert result.seconds >= result.nbytes / MAX_BYTES_PER_SECOND, result
        # The snapshots become what memory must hold: a store changes only the
        # pool (from the unchanged layers), a load only the layers.
        expected_pool, expected_layers = pool_before, layers_before
        for d, p in pairs if copies else ():
            offset = geometry.slot_offset(p, rank)
            for rows, page in zip(expected_layers, page_bytes, strict=True):
                if job.kind == "store":
                    expected_pool[offset : offset + page] = rows[d]
                else:
                    rows[d] = pool_before[offset : offset + page]
                offset += page
        assert torch.equal(region, expected_pool), "the pool does not hold what the job copied"
        for i, t in enumerate(layers):
            assert torch.equal(as_rows(t), expected_layers[i]), f"layer {i} is not what was copied"
        return result
    finally:
        del region  # Pool.close() unmaps: no view of the region may outlive the check


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A cache tensor's bytes, one row per device block (a copy if it is strided)."""
    return t.contiguous().view(len(t), -1).view(torch.uint8)


def round_trip(
    pool: Pool,
    backend: CpuBackend,
    layers: list[torch.Tensor],
    device: list[int],
    pooled: list[int],
    rank: int = 0,
) -> None:
    """Store, check the slots byte for byte against SPEC section 3, wipe, load, compare."""
    original = [t.clone() for t in layers]
    copy_job(pool, backend, layers, CopyJob(1, "store", device, pooled), rank)
    for t in layers:
        t.zero_()
    copy_job(pool, backend, layers, CopyJob(2, "load", device, pooled), rank, wait=True)
    moved = torch.zeros(len(layers[0]), dtype=torch.bool)
    moved[device] = True
    for t, o in zip(layers, original, strict=True):
        assert torch.equal(t[moved].view(torch.uint8), o[moved].view(torch.uint8))
        assert not t[~moved].view(torch.uint8).any()


# Every pattern on the default settings; the forced paths on one small and one large page.
CONTIGUOUS = [
    (page, path)
    for page in (16 * KiB, 256 * KiB, 2 * MiB, 6 * KiB + 2)
    for path in PATHS
    if path == "default" or page in (16 * KiB, 2 * MiB)
]
DTYPES = {16 * KiB: torch.bfloat16, 256 * KiB: torch.float32, 2 * MiB: torch.uint8}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("page", "path"), CONTIGUOUS)
def test_contiguous_round_trip(pools: list[Pool], pattern: str, page: int, path: str) -> None:
    n = 3 if page >= 2 * MiB else 10
    num_device, num_pool = 3 * n, 3 * n
    pool = new_pool(pools, page, num_pool)
    kv = random_pages(num_device, page, DTYPES.get(page, torch.int16), seed=page)
    backend = pool.backend(kv, **PATHS[path])
    device, pooled = pairs(pattern, n, num_device, num_pool, seed=n)
    round_trip(pool, backend, [kv], device, pooled)


PER_LAYER = [
    (layers, page, path)
    for layers, page in ((32, 512), (4, 8 * KiB), (2, 256 * KiB), (3, 6))
    for path in PATHS
    if path == "default" or layers in (32, 2)
]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("layers", "page", "path"), PER_LAYER)
def test_per_layer_round_trip(
    pools: list[Pool], pattern: str, layers: int, page: int, path: str
) -> None:
    n = 3 if page >= 256 * KiB else 10
    num_device, num_pool = 3 * n, 3 * n
    pool = new_pool(pools, layers * page, num_pool)
    dtype = torch.float16 if page % 2 == 0 else torch.uint8
    kv = [random_pages(num_device, page, dtype, seed=i) for i in range(layers)]
    backend = pool.backend(kv, **PATHS[path])
    device, pooled = pairs(pattern, n, num_device, num_pool, seed=layers)
    round_trip(pool, backend, kv, device, pooled)


def test_per_layer_pages_of_different_sizes(pools: list[Pool]) -> None:
    pages = [512, 1024, 256, 2048]
    pool = new_pool(pools, sum(pages), 9)
    kv = [random_pages(8, page, torch.bfloat16, seed=page) for page in pages]
    backend = pool.backend(kv)
    assert backend.views is not None and backend.views.layout.layer_offsets == (0, 512, 1536, 1792)
    round_trip(pool, backend, kv, [7, 0, 3, 4, 5], [8, 2, 0, 1, 6])


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("layers", [1, 4])
def test_sharded_rank_touches_only_its_own_slots(pools: list[Pool], rank: int, layers: int) -> None:
    page = 16 * KiB // layers
    pool = new_pool(pools, 16 * KiB, 10, world=4)
    kv = [random_pages(12, page, torch.bfloat16, seed=i) for i in range(layers)]
    backend = pool.backend(kv if layers > 1 else kv[0], rank=rank)
    device, pooled = [11, 0, 5, 6, 7, 2], [9, 3, 4, 5, 6, 0]
    round_trip(pool, backend, kv, device, pooled, rank=rank)
    geometry = pool.geometry
    for p in range(geometry.num_blocks):
        for other in range(4):
            if other != rank or p not in pooled:
                assert not any(pool.bytes_at(geometry.slot_offset(p, other), geometry.slot_bytes))


def test_replicated_pool_has_one_writer_and_every_rank_loads(pools: list[Pool]) -> None:
    pool = new_pool(pools, 16 * KiB, 6, world=2, replicated=True)
    kv0 = random_pages(8, 16 * KiB, torch.bfloat16, seed=0)
    kv1 = random_pages(8, 16 * KiB, torch.bfloat16, seed=1)  # a different rank's cache
    rank0, rank1 = pool.backend(kv0, rank=0), pool.backend(kv1, rank=1)
    device, pooled = [3, 1, 4], [5, 0, 2]

    skipped = copy_job(pool, rank1, [kv1], CopyJob(7, "store", device, pooled, writer=False), 1)
    assert skipped.nbytes == 0
    assert not any(pool.mm[:])  # the non-writer copied nothing
    stored = copy_job(pool, rank0, [kv0], CopyJob(7, "store", device, pooled, writer=True))
    assert stored.nbytes == 3 * 16 * KiB

    kv1.zero_()
    loaded = copy_job(pool, rank1, [kv1], CopyJob(8, "load", device, pooled), rank=1)
    assert loaded.nbytes == 3 * 16 * KiB
    assert torch.equal(kv1[device].view(torch.uint8), kv0[device].view(torch.uint8))


def test_block_stride_wider_than_the_page(pools: list[Pool]) -> None:
    # Each layer is half of a wider allocation: pages 4 KiB, blocks 8 KiB apart.
    wide = [random_pages(6, 8 * KiB, torch.float16, seed=i).view(6, 2, -1) for i in range(2)]
    layers = [w[:, 0] for w in wide]
    other_halves = [w[:, 1].clone() for w in wide]
    pool = new_pool(pools, 8 * KiB, 6)
    backend = pool.backend(layers)
    round_trip(pool, backend, layers, [5, 2, 3], [0, 4, 1])
    for w, half in zip(wide, other_halves, strict=True):
        assert as_bytes(w[:, 1]) == as_bytes(half)


def test_element_width_follows_the_sizes(pools: list[Pool]) -> None:
    cases = [
        ([16 * KiB], torch.int64),
        ([12], torch.int32),
        ([6, 6], torch.int16),
        ([3, 5], torch.uint8),
    ]
    for pages, dtype in cases:
        pool = new_pool(pools, sum(pages), 4)
        backend = pool.backend([random_pages(4, page, torch.uint8, seed=1) for page in pages])
        assert backend.views is not None and backend.views.dtype == dtype


# -- failures -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "device", "pooled", "message"),
    [
        ("store", [0, 8], [0, 1], "device block id 8"),
        ("load", [0, -1], [0, 1], "device block id -1"),
        ("store", [0, 1], [0, 6], "pool block id 6"),
        ("load", [0, 1], [0], "1 pool block ids"),
        ("store", [0, 1], [3, 3], "pool block 3 twice"),
        ("load", [2, 2], [0, 1], "device block 2 twice"),
        # 0-d tensors hash by identity: repeats must still be seen
        ("load", torch.tensor([2, 2]), torch.tensor([0, 1]), "device block 2 twice"),
        ("store", torch.tensor([0, 1]), torch.tensor([4, 4]), "pool block 4 twice"),
        ("swap", [0], [0], "kind"),
    ],
)
@pytest.mark.parametrize("path", ["default", "native"])
def test_bad_job_fails_cleanly_and_copies_nothing(
    pools: list[Pool], kind: str, device: Any, pooled: Any, message: str, path: str
) -> None:
    pool = new_pool(pools, 16 * KiB, 6)
    kv = random_pages(8, 16 * KiB, torch.bfloat16, seed=3)
    backend = pool.backend(kv, **PATHS[path])
    pool.mm[:] = bytes(range(256)) * (len(pool.mm) // 256)
    host_before, kv_before = pool.mm[:], kv.clone()
    backend.submit(CopyJob(9, kind, device, pooled))
    (result,) = backend.poll()
    assert (result.job_id, result.ok, result.nbytes) == (9, False, 0)
    assert result.error is not None and message in result.error
    assert pool.mm[:] == host_before
    assert torch.equal(kv.view(torch.uint8), kv_before.view(torch.uint8))
    copy_job(pool, backend, [kv], CopyJob(10, "store", [0], [0]))  # the backend still works


@pytest.mark.parametrize("path", ["default", "native", "no_span"])
def test_a_cache_resized_under_the_backend_is_refused(pools: list[Pool], path: str) -> None:
    """Copies that keep raw addresses must never follow a re-allocated tensor's old memory."""
    pool = new_pool(pools, 4 * 512, 6)
    kv = [random_pages(8, 512, torch.uint8, seed=i) for i in range(4)]
    backend = pool.backend(kv, **PATHS[path])
    assert copy_job(pool, backend, kv, CopyJob(1, "store", [0, 1], [0, 1])).nbytes == 2 * 4 * 512
    kv[2].resize_(64, 1 << 20)  # far larger: the storage moves
    host_before = pool.mm[:]
    backend.submit(CopyJob(2, "store", [2, 3], [2, 3]))
    (result,) = backend.poll()
    assert not result.ok and result.error is not None and "moved" in result.error
    assert pool.mm[:] == host_before


def test_results_come_once_from_poll_or_wait(pools: list[Pool]) -> None:
    pool = new_pool(pools, 16 * KiB, 4)
    kv = random_pages(4, 16 * KiB, torch.bfloat16, seed=0)
    backend = pool.backend(kv)
    for job_id in (1, 2, 3, 4):
        backend.submit(CopyJob(job_id, "store", [job_id - 1], [job_id - 1]))
    assert [r.job_id for r in backend.wait([3, 1, 99, 3])] == [3, 1]
    assert [r.job_id for r in backend.poll()] == [2, 4]
    assert backend.poll() == [] and backend.wait([1, 2]) == []
    assert copy_job(pool, backend, [kv], CopyJob(5, "load", [], [])).nbytes == 0


def test_closed_backend_refuses_jobs_and_frees_the_region(pools: list[Pool]) -> None:
    pool = new_pool(pools, 16 * KiB, 4)
    with pool.backend(random_pages(4, 16 * KiB, torch.bfloat16, seed=0)) as backend:
        backend.submit(CopyJob(1, "store", [0], [0]))
    with pytest.raises(BadRequest, match="closed"):
        backend.submit(CopyJob(2, "store", [0], [0]))
    backend.close()  # idempotent
    pools.remove(pool)
    pool.mm.close()  # no view of the region is left


def test_make_backend_picks_by_device(pools: list[Pool]) -> None:
    pool = new_pool(pools, 16 * KiB, 4)
    kv = random_pages(4, 16 * KiB, torch.bfloat16, seed=0)
    for device in (None, "cpu"):
        backend = make_backend(device, kv, pool.mm, pool.geometry, 0)
        assert isinstance(backend, CpuBackend)
        backend.close()
    with pytest.raises(BadRequest, match="no transfer backend"):
        make_backend("tpu", kv, pool.mm, pool.geometry, 0)
    with pytest.raises(BadRequest, match="CUDA tensors"):
        make_backend("cuda", kv, pool.mm, pool.geometry, 0)


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ([], "no tensor"),
        (
            [
                torch.zeros(4, 8 * KiB, dtype=torch.uint8),
                torch.zeros(5, 8 * KiB, dtype=torch.uint8),
            ],
            "5 blocks",
        ),
        (torch.zeros(4, 8 * KiB, 2, dtype=torch.uint8)[:, :, 0], "contiguous"),
        (torch.zeros(4, 8 * KiB, dtype=torch.uint8), "slot_bytes"),
        (torch.zeros(0, 16 * KiB, dtype=torch.uint8), "no blocks"),
    ],
)
def test_caches_that_do_not_fit_are_refused(pools: list[Pool], kv: Any, message: str) -> None:
    pool = new_pool(pools, 16 * KiB, 4)
    with pytest.raises(BadRequest, match=message):
        CpuBackend(kv, pool.mm, pool.geometry, 0)


def test_regions_that_do_not_fit_are_refused(pools: list[Pool]) -> None:
    pool = new_pool(pools, 16 * KiB, 4)
    kv = torch.zeros(4, 16 * KiB, dtype=torch.uint8)
    with pytest.raises(BadRequest, match="geometry needs"):
        CpuBackend(kv, bytearray(16 * KiB), pool.geometry, 0)
    with pytest.raises(BadRequest, match="read-only"):
        CpuBackend(kv, bytes(pool.geometry.size_bytes), pool.geometry, 0)
    with pytest.raises(BadRequest, match="buffer protocol"):
        CpuBackend(kv, object(), pool.geometry, 0)  # type: ignore[arg-type]
