"""The native block copier (`kvd_client._blockcopy`) against a byte-for-byte reference:
every page size and alignment, streaming stores on and off, one to many threads."""

from __future__ import annotations

import mmap
import platform
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvd_client.backends import CopyJob, native
from kvd_client.backends.cpu import CpuBackend
from kvd_client.backends.native import BlockCopier, by_device, last_level_cache_bytes
from kvd_client.geometry import Geometry

needs_native = pytest.mark.skipif(
    not native.available(), reason="the native copier is not built (no C compiler)"
)


@needs_native
def test_the_copier_is_built_by_make() -> None:
    """`make test` installs with a compiler: a silent build failure must show here."""
    from kvd_client import _blockcopy

    assert native.available()
    if platform.machine() in ("x86_64", "AMD64"):
        assert _blockcopy.streaming_kind() in ("avx512", "avx2", "sse2")


def _ptrs(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_ids: list[int],
    src_ids: list[int],
    layers: list[tuple[int, int, int, int, int]],
    streaming: bool,
    threads: int,
) -> None:
    """`layers`: (dst offset, dst stride, src offset, src stride, size) per layer, in bytes."""
    from kvd_client import _blockcopy

    d_ids, s_ids = _ptrs(dst_ids), _ptrs(src_ids)
    d_base = _ptrs([dst.data_ptr() + lay[0] for lay in layers])
    d_stride = _ptrs([lay[1] for lay in layers])
    s_base = _ptrs([src.data_ptr() + lay[2] for lay in layers])
    s_stride = _ptrs([lay[3] for lay in layers])
    sizes = _ptrs([lay[4] for lay in layers])
    _blockcopy.copy_blocks(
        len(dst_ids),
        len(layers),
        d_ids.data_ptr(),
        s_ids.data_ptr(),
        d_base.data_ptr(),
        d_stride.data_ptr(),
        s_base.data_ptr(),
        s_stride.data_ptr(),
        sizes.data_ptr(),
        streaming,
        threads,
    )


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    "sizes",
    [
        [512] * 32,  # 16 KiB per-layer slots: whole lines
        [64, 128, 4096],  # whole lines, different sizes
        [8, 24, 520, 100],  # not whole lines: memcpy even when streaming
        [2 << 20],  # one 2 MiB page
    ],
    ids=["512x32", "lines", "odd", "2MiB"],
)
@pytest.mark.parametrize("misalign", [0, 8])
def test_pages_land_exactly_where_the_layout_says(
    threads: int, streaming: bool, sizes: list[int], misalign: int
) -> None:
    rnd = random.Random(len(sizes) * 31 + threads)
    n_src, n_dst, n = 9, 11, 6
    slot = sum(sizes)
    # src: per-layer tensors side by side, rows of one page each (device-like);
    # dst: slots of all layers back to back (pool-like), at `misalign` bytes.
    src_stride = [s + 64 for s in sizes]  # padded rows: strides wider than pages
    src_offsets = [0]
    for s in src_stride[:-1]:
        src_offsets.append(src_offsets[-1] + n_src * s)
    src = torch.randint(0, 256, (src_offsets[-1] + n_src * src_stride[-1],), dtype=torch.uint8)
    dst = torch.zeros(misalign + n_dst * slot, dtype=torch.uint8)
    dst_offsets = [misalign + sum(sizes[:i]) for i in range(len(sizes))]
    src_ids = rnd.sample(range(n_src), n)
    dst_ids = rnd.sample(range(n_dst), n)
    layers = [
        (dst_offsets[i], slot, src_offsets[i], src_stride[i], sizes[i]) for i in range(len(sizes))
    ]
    _copy(dst, src, dst_ids, src_ids, layers, streaming, threads)

    expected = torch.zeros_like(dst)
    for d, s in zip(dst_ids, src_ids, strict=True):
        for do, ds, so, ss, size in layers:
            expected[do + d * ds : do + d * ds + size] = src[so + s * ss : so + s * ss + size]
    assert torch.equal(dst, expected)


@needs_native
def test_no_pairs_copy_nothing() -> None:
    dst = torch.zeros(64, dtype=torch.uint8)
    src = torch.ones(64, dtype=torch.uint8)
    _copy(dst, src, [], [], [(0, 64, 0, 64, 64)], True, 2)
    assert not dst.any()


@needs_native
@pytest.mark.parametrize(
    ("layers", "threads", "error"),
    [
        ([], 1, ValueError),
        ([(0, 64, 0, 64, 64)], 0, ValueError),
        ([(0, 64, 0, 64, 64)], 65, ValueError),
    ],
)
def test_bad_arguments_are_refused(
    layers: list[tuple[int, int, int, int, int]], threads: int, error: type[Exception]
) -> None:
    dst = torch.zeros(64, dtype=torch.uint8)
    src = torch.ones(64, dtype=torch.uint8)
    with pytest.raises(error):
        _copy(dst, src, [0], [0], layers, False, threads)
    assert not dst.any()


@pytest.mark.parametrize(
    ("device", "pool"),
    [
        ([0, 1, 2, 3], [7, 5, 6, 4]),  # already in order
        ([3, 1, 0, 2], [10, 11, 12, 13]),  # a shuffled range: placed, not sorted
        ([40, 7, 19, 3], [1, 2, 3, 4]),  # sparse: sorted
        ([5, 2, 5, 3], [1, 2, 3, 4]),  # a store may read one device block twice
        ([6], [0]),
    ],
)
def test_by_device_orders_pairs_and_keeps_them_together(device: list[int], pool: list[int]) -> None:
    dev, pooled = by_device(_ptrs(device), _ptrs(pool))
    assert dev.tolist() == sorted(device)
    assert sorted(zip(dev.tolist(), pooled.tolist(), strict=True)) == sorted(
        zip(device, pool, strict=True)
    )
    # Equal device ids keep their job order (a store's later pair wins nothing: both are read).
    assert [p for d, p in zip(dev.tolist(), pooled.tolist(), strict=True) if d == 5] == [
        p for d, p in zip(device, pool, strict=True) if d == 5
    ]


@needs_native
def test_the_backend_goes_native_from_native_min_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs under `native_min_bytes` take torch copies, larger ones the native copier;
    both land the same bytes."""
    calls: list[int] = []
    real = BlockCopier.copy

    def counting(self: BlockCopier, store: bool, dev: Any, pool: Any, threads: int) -> None:
        calls.append(len(dev))
        real(self, store, dev, pool, threads)

    monkeypatch.setattr(BlockCopier, "copy", counting)
    slot = 4096
    g = Geometry.plan(slot_bytes=slot, world_size=1, replicated=False, capacity_bytes=8 * slot)
    region = mmap.mmap(-1, g.size_bytes)
    host = torch.frombuffer(region, dtype=torch.int64).view(-1, slot // 8)
    kv = torch.randint(0, 1 << 30, (8, slot // 8), dtype=torch.int64)
    backend = CpuBackend(kv, region, g, 0, native_min_bytes=3 * slot)
    try:
        backend.submit(CopyJob(1, "store", [5, 1], [0, 1]))  # 2 slots: torch
        backend.submit(CopyJob(2, "store", [7, 2, 3], [4, 3, 2]))  # 3 slots: native
        assert [r.ok for r in backend.poll()] == [True, True]
        assert calls == [3]
        for d, p in ((5, 0), (1, 1), (7, 4), (2, 3), (3, 2)):
            assert torch.equal(host[g.slot_offset(p, 0) // slot], kv[d])
    finally:
        backend.close()
        del host
        region.close()


def _cache(root: Path, index: int, level: str, size: str) -> None:
    path = root / f"index{index}"
    path.mkdir()
    (path / "level").write_text(level + "\n")
    (path / "size").write_text(size + "\n")


def test_last_level_cache_is_the_highest_level(tmp_path: Path) -> None:
    _cache(tmp_path, 0, "1", "48K")
    _cache(tmp_path, 1, "1", "32K")
    _cache(tmp_path, 2, "2", "2048K")
    _cache(tmp_path, 3, "3", "491520K")
    assert last_level_cache_bytes(tmp_path) == 480 << 20


def test_unknown_cache_sizes_read_as_none(tmp_path: Path) -> None:
    assert last_level_cache_bytes(tmp_path / "missing") is None
    for name, size in (("garbled", "lots"), ("empty", "")):
        (tmp_path / name).mkdir()
        _cache(tmp_path / name, 0, "2", size)
        assert last_level_cache_bytes(tmp_path / name) is None


def test_native_min_bytes_comes_from_the_environment() -> None:
    from kvd_client.backends.native import default_native_min_bytes
    from kvd_client.errors import BadRequest
    from kvd_client.settings import ClientSettings

    assert ClientSettings.from_env({"KVD_NATIVE_MIN_BYTES": "0"}).native_min_bytes == 0
    assert ClientSettings.from_env({"KVD_NATIVE_MIN_BYTES": " 4096 "}).native_min_bytes == 4096
    for bad in ("-1", "1MiB", "lots"):
        with pytest.raises(BadRequest, match="KVD_NATIVE_MIN_BYTES"):
            ClientSettings.from_env({"KVD_NATIVE_MIN_BYTES": bad})
    assert ClientSettings.from_env({}).native_min_bytes is None  # the backend's default:
    cache = last_level_cache_bytes()
    assert default_native_min_bytes() == (cache // 4 if cache else 32 << 20)
