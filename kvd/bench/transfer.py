"""Runs in the operator's shell: `kvd bench transfer`, a backend's scattered copies vs memcpy.

For each layout (one contiguous page per block, or 32 per-layer pages) and
slot size (16 KiB, 256 KiB, 2 MiB): a device cache and a host region of
about `--total-mb` each, and a transfer backend built over them exactly as a
TP worker builds it. One store job then one load job move every block, with
the device block ids and the pool block ids each in a random order (a random
permutation of both sides: no two neighbours on one side are neighbours on
the other), so no copy is contiguous across blocks.

The yardstick, in the same run and with the same torch thread settings: one
contiguous `copy_` of the same bytes each way (on CUDA, one copy between the
device and the registered, pinned region). Every figure is the best of
`--repeats`, the measurements interleaved so a noisy neighbour hits all
alike. `ratio` is the lower of store and load over memcpy; SPEC section 10
asks >= 0.9 (>= 0.7 at 16 KiB). A load is checked to bring back what the
store wrote.
"""

from __future__ import annotations

import argparse
import mmap
import time
from collections.abc import Callable

import torch

from kvd.bench.report import Row
from kvd.bench.suites import SuiteError, positive_int
from kvd_client.backends import CopyJob, TransferBackend, make_backend
from kvd_client.geometry import Geometry

SLOT_SIZES = (16 << 10, 256 << 10, 2 << 20)
LAYOUTS = ("contiguous", "per_layer")
NUM_LAYERS = 32
MIN_RATIO = 0.9
MIN_RATIO_SMALL = 0.7  # at 16 KiB slots
SEED = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument(
        "--total-mb",
        type=positive_int,
        default=256,
        metavar="MB",
        help="bytes moved per measurement, in MiB (default: 256)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        metavar="N",
        help="keep the best of N interleaved measurements (default: 5)",
    )


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


def _measure(
    layout: str, slot_bytes: int, total_bytes: int, repeats: int, device: str
) -> Row:
    num_blocks = max(1, total_bytes // slot_bytes)
    nbytes = num_blocks * slot_bytes
    geometry = Geometry.plan(
        slot_bytes=slot_bytes,
        world_size=1,
        replicated=False,
        capacity_bytes=num_blocks * slot_bytes,
    )
    region = mmap.mmap(-1, geometry.size_bytes)
    host = torch.frombuffer(region, dtype=torch.uint8)
    host.fill_(0)  # prefault: page faults are not the backend's to pay
    caches = _caches(layout, num_blocks, slot_bytes, device)
    expected = [c.clone() for c in caches]
    kv: torch.Tensor | list[torch.Tensor] = caches[0] if layout == "contiguous" else caches
    flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    gen = torch.Generator().manual_seed(SEED)
    device_ids = torch.randperm(num_blocks, generator=gen).tolist()
    pool_ids = torch.randperm(geometry.num_blocks, generator=gen)[:num_blocks].tolist()
    backend: TransferBackend = make_backend(device, kv, region, geometry, 0)
    host_flat = host[:nbytes]
    if device == "cuda":
        # The backend registered the region; this view of it is pinned memory.
        def memcpy_store() -> None:
            host_flat.copy_(flat, non_blocking=True)

        def memcpy_load() -> None:
            flat.copy_(host_flat, non_blocking=True)
    else:

        def memcpy_store() -> None:
            host_flat.copy_(flat)

        def memcpy_load() -> None:
            flat.copy_(host_flat)

    job_id = 0

    def job(kind: str) -> None:
        nonlocal job_id
        job_id += 1
        backend.submit(CopyJob(job_id, kind, device_ids, pool_ids))
        (result,) = backend.wait([job_id])
        if not result.ok:
            raise SuiteError(f"{kind} job failed: {result.error}")

    best = {"memcpy_store": 1e30, "store": 1e30, "memcpy_load": 1e30, "load": 1e30}
    steps: dict[str, Callable[[], object]] = {
        "memcpy_store": memcpy_store,
        "store": lambda: job("store"),
        "memcpy_load": memcpy_load,
        "load": lambda: job("load"),
    }
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
        del host, host_flat
        region.close()
    gb = 1e9
    store_gbps = nbytes / best["store"] / gb
    load_gbps = nbytes / best["load"] / gb
    memcpy_gbps = 2 * nbytes / (best["memcpy_store"] + best["memcpy_load"]) / gb
    return {
        "layout": layout,
        "slot_bytes": slot_bytes,
        "num_blocks": num_blocks,
        "store_gbps": round(store_gbps, 3),
        "load_gbps": round(load_gbps, 3),
        "memcpy_gbps": round(memcpy_gbps, 3),
        "ratio": round(min(store_gbps, load_gbps) / memcpy_gbps, 3),
    }


def run(args: argparse.Namespace) -> list[Row]:
    device: str = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SuiteError("--device cuda: torch sees no CUDA device")
    total = args.total_mb << 20
    return [
        _measure(layout, slot, total, args.repeats, device)
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
    threads = f"torch threads: {torch.get_num_threads()}"
    return [*misses, threads] if misses else [f"every ratio meets its goal; {threads}"]
