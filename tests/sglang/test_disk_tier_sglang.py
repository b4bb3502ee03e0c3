"""SGLang's HiCache backend over a daemon with a disk tier: pages RAM let go come back from disk."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvd_tools import sglang_harness as h
from kvd_tools.launcher import DaemonProcess
from tests.sglang.test_backend import backend_for, fill, read

PAGE = 16
PAGE_BYTES = 16 << 10  # 2 layers x K,V x 2 heads x 64 x bf16 x 16 tokens
RAM_PAGES = 16
MAX_TOTAL = 64 << 20


@pytest.fixture
def disk_daemon() -> Iterator[DaemonProcess]:
    with tempfile.TemporaryDirectory(prefix="kvd-disk-") as d:
        # The pool's slab: disk_bytes x its RAM / max_total_bytes, 8x its RAM.
        daemon = DaemonProcess(disk_dir=d, disk_bytes=str(8 * MAX_TOTAL + (8 << 20)),
                               max_total_bytes=str(MAX_TOTAL)).start()  # fmt: skip
        try:
            yield daemon
        finally:
            daemon.stop()


def test_pages_pushed_out_of_ram_are_found_and_loaded_from_disk(
    disk_daemon: DaemonProcess,
) -> None:
    host = h.host_pool(h.device_pool(tokens=128, page_size=PAGE), layout="page_first")
    extra = h.kvd_extra(disk_daemon.endpoint, "sgl-disk", kvd_capacity_bytes=RAM_PAGES * PAGE_BYTES)
    backend = backend_for(host, extra)
    try:
        assert backend.choice.layout.slot_bytes == PAGE_BYTES
        keys = h.page_hashes(list(range(6 * PAGE)), PAGE)
        src = host.alloc(6 * PAGE)
        want = fill(host, src, seed=4)
        assert backend.batch_set_v1(keys, src) == [True] * 6
        written_behind(backend, 6)
        for round_ in range(3):  # 18 other pages through a pool of 16: the first 6 go
            other = h.page_hashes(list(range(10_000 * (round_ + 1), 10_000 * (round_ + 1)
                                             + 6 * PAGE)), PAGE)  # fmt: skip
            fill(host, src, seed=10 + round_)
            assert backend.batch_set_v1(other, src) == [True] * 6
            written_behind(backend, 12 + 6 * round_)
        assert backend.batch_exists(keys) == 6  # waits while the daemon reads them back
        dst = host.alloc(6 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 6
        got = read(host, dst)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert backend.scheduler.stats().counters["disk.hits"] >= 6
    finally:
        backend.close()


def written_behind(backend: Any, n: int) -> None:
    """Waits until the pool's slab holds `n` blocks (the daemon writes behind)."""
    deadline = time.monotonic() + 10
    while disk_blocks(backend) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert disk_blocks(backend) == n


def disk_blocks(backend: Any) -> int:
    stats = backend.scheduler.stats()
    return next(pi.disk_blocks for pi in stats.pools if pi.name == "sgl-disk")
