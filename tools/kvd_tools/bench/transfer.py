"""Runs in the operator's shell: `kvd bench transfer`, a backend's scattered copies vs memcpy.

For each layout (one contiguous page per block, or 32 per-layer pages) and
slot size (16 KiB, 256 KiB, 2 MiB): a device cache and a host region of
about `--total-mb` each, and a transfer backend built over them exactly as a
TP worker builds it. One store job then one load job move every block, with
the device block ids and the pool block ids each in a random order (a random
permutation of both sides), so almost no two blocks adjacent on one side are
adjacent on the other and no copy is contiguous across blocks. Each side is
a shuffled range, so torch's copies gather into the destination in place;
ids that are random subsets on both sides take their staged path instead
(two passes, about half as fast). The native copier takes both alike: on
random halves of 512 MiB on each side it measured 0.90 to 1.12 of memcpy,
torch's copies 0.28 to 0.42.

On the CPU, `--copier` picks how the backend copies: `native` (the block
copier built with the client, `kvd_client.backends.native`, for every job),
`torch` (torch indexing alone, what an install without a C compiler gets) or
`auto` (the default: the backend as a worker builds it, native for jobs of a
quarter of the last-level cache and more). Each row names the one that ran.

The yardstick, in the same run and with the same torch thread settings: one
contiguous `copy_` of the same bytes each way (on CUDA, one copy between the
device and the registered, pinned region). Every figure is the best of
`--repeats`, the measurements interleaved so a noisy neighbour hits all
alike. `ratio` is the lower of store and load over memcpy; SPEC section 10
asks >= 0.9 (>= 0.7 at 16 KiB). A load is checked to bring back what the
store wrote. Memory: three times `--total-mb` on the device (the cache, its
expected copy, the memcpy buffer) plus the region.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import time
from collections.abc import Callable

import torch

from kvd_client.backends import CopyJob, TransferBackend, make_backend, native
from kvd_client.backends.cpu import CpuBackend
from kvd_client.geometry import Geometry
from kvd_tools.bench.report import Row
from kvd_tools.bench.suites import SuiteError

SLOT_SIZES = (16 << 10, 256 << 10, 2 << 20)
LAYOUTS = ("contiguous", "per_layer")
NUM_LAYERS = 32
MIN_RATIO = 0.9
MIN_RATIO_SMALL = 0.7  # at 16 KiB slots
SEED = 0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _caches(layout: str, num_blocks: int, slot_bytes: int, device: str) -> list[torch.Tensor]:
    """Device pages holding distinct int64 values, so a wrong copy cannot go unseen."""
    if layout == "contiguous":
        shapes = [(num_blocks, slot_bytes // 8)]
    else:
        shapes = [(num_blocks, slot_bytes // NUM_LAYERS // 8)] * NUM_LAYERS
    caches = []
    first = 0
    for shape in shapes:
        n = shape[0] * shape[1]
        caches.append(torch.arange(first, first + n, dtype=torch.int64, device=device).view(shape))
        first += n
    return caches


def check_copier(device: str, copier: str) -> None:
    """`SuiteError` if `--copier` cannot run on `device`."""
    if device == "cuda" and copier != "auto":
        raise SuiteError("--copier applies to --device cpu; CUDA copies with its DMA engines")
    if copier == "native" and not native.available():
        raise SuiteError(
            "--copier native: the native block copier is not built (install kvd-client "
            "with a C compiler), or use --copier torch"
        )


def _backend(
    device: str, copier: str, kv: torch.Tensor | list[torch.Tensor], region: mmap.mmap, g: Geometry
) -> TransferBackend:
    if copier == "torch":
        return CpuBackend(kv, region, g, 0, native=False)
    if copier == "native":
        return CpuBackend(kv, region, g, 0, native_min_bytes=0)
    return make_backend(device, kv, region, g, 0)


def _measure(
    layout: str, slot_bytes: int, total_bytes: int, repeats: int, device: str, copier: str
) -> Row:
    num_blocks = max(1, total_bytes // slot_bytes)
    geometry = Geometry.plan(
        slot_bytes=slot_bytes,
        world_size=1,
        replicated=False,
        capacity_bytes=num_blocks * slot_bytes,
    )
    region = mmap.mmap(-1, geometry.size_bytes)
    try:
        seconds, used = _time_jobs(layout, geometry, region, repeats, device, copier)
    finally:
        with contextlib.suppress(BufferError):  # a failed run's traceback holds a view
            region.close()
    nbytes = geometry.num_blocks * slot_bytes
    store, load = nbytes / seconds["store"], nbytes / seconds["load"]
    memcpy = 2 * nbytes / (seconds["memcpy_store"] + seconds["memcpy_load"])
    return {
        "layout": layout,
        "slot_bytes": slot_bytes,
        "num_blocks": geometry.num_blocks,
        "store_gbps": round(store / 1e9, 3),
        "load_gbps": round(load / 1e9, 3),
        "memcpy_gbps": round(memcpy / 1e9, 3),
        "ratio": round(min(store, load) / memcpy, 3),
        "copier": used,
    }


def _time_jobs(
    layout: str, geometry: Geometry, region: mmap.mmap, repeats: int, device: str, copier: str
) -> tuple[dict[str, float], str]:
    """Best seconds of each step over `repeats` interleaved rounds, and the copier used."""
    num_blocks, slot_bytes = geometry.num_blocks, geometry.slot_bytes
    nbytes = num_blocks * slot_bytes
    host = torch.frombuffer(region, dtype=torch.uint8)[:nbytes]
    host.fill_(0)  # prefault: page faults are not the backend's to pay
    caches = _caches(layout, num_blocks, slot_bytes, device)
    expected = [c.clone() for c in caches]
    kv: torch.Tensor | list[torch.Tensor] = caches[0] if layout == "contiguous" else caches
    flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(SEED)
    device_ids = torch.randperm(num_blocks, generator=gen).tolist()
    pool_ids = torch.randperm(num_blocks, generator=gen).tolist()
    # Built before the memcpy yardstick: on CUDA it registers (pins) the region.
    backend = _backend(device, copier, kv, region, geometry)
    used = backend.copier_for(nbytes) if isinstance(backend, CpuBackend) else "cuda"
    job_ids = itertools.count(1)

    def job(kind: str) -> None:
        job_id = next(job_ids)
        backend.submit(CopyJob(job_id, kind, device_ids, pool_ids))
        (result,) = backend.wait([job_id])
        if not result.ok:
            raise SuiteError(f"{layout} {slot_bytes}: {kind} job failed: {result.error}")

    non_blocking = device == "cuda"
    steps: dict[str, Callable[[], object]] = {
        "memcpy_store": lambda: host.copy_(flat, non_blocking=non_blocking),
        "store": lambda: job("store"),
        "memcpy_load": lambda: flat.copy_(host, non_blocking=non_blocking),
        "load": lambda: job("load"),
    }
    best = dict.fromkeys(steps, float("inf"))
    try:
        for _ in range(repeats):
            for name, step in steps.items():
                best[name] = min(best[name], _timed(step, device))
        for cache in caches:
            cache.zero_()
        job("load")
        _sync(device)
        if not all(torch.equal(c, e) for c, e in zip(caches, expected, strict=True)):
            raise SuiteError(f"{layout} {slot_bytes}: a load did not bring back what was stored")
    finally:
        backend.close()
    return best, used


def run(args: argparse.Namespace) -> list[Row]:
    device: str = args.device
    check_copier(device, args.copier)
    if device == "cuda" and not torch.cuda.is_available():
        raise SuiteError("--device cuda: torch sees no CUDA device")
    total = args.total_mb << 20
    return [
        _measure(layout, slot, total, args.repeats, device, args.copier)
        for layout in LAYOUTS
        for slot in SLOT_SIZES
    ]


def summarize(rows: list[Row]) -> list[str]:
    """One line per row that misses the SPEC section 10 goal, or one saying none does."""
    misses = []
    for row in rows:
        slot = row["slot_bytes"]
        ratio = row["ratio"]
        assert isinstance(slot, int) and isinstance(ratio, float)
        goal = MIN_RATIO_SMALL if slot <= SLOT_SIZES[0] else MIN_RATIO
        if ratio < goal:
            misses.append(f"{row['layout']} {slot >> 10} KiB: ratio {ratio:.2f} < goal {goal}")
    copiers = sorted({str(row["copier"]) for row in rows})
    copier = ", ".join(_COPIER_WORDS.get(c, c) for c in copiers)
    setting = f"copier: {copier}; torch threads: {torch.get_num_threads()}"
    return [*misses, setting] if misses else [f"every ratio meets its goal; {setting}"]


_COPIER_WORDS = {
    "native": f"native ({native.streaming_kind()} streaming stores)",
    "torch": "torch indexing",
    "cuda": "CUDA copies on the registered region",
}
