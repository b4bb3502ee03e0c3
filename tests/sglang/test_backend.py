"""SGLang's host pools and cache controller (0.5.23, on CPU) driving kvd's HiCache backend."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvd_tools import sglang_harness as h
from kvd_tools.launcher import DaemonProcess

PAGE = 16


def fill(host: Any, indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Random bytes in the pages at `indices` (SGLang's flat pages); returns them."""
    g = torch.Generator().manual_seed(seed)
    pages = []
    for i in range(0, indices.numel(), host.page_size):
        page = torch.randint(0, 256, (host.size_per_token * host.page_size,),
                             dtype=torch.uint8, generator=g)  # fmt: skip
        host.set_from_flat_data_page(int(indices[i]), page.view(host.dtype))
        pages.append(page)
    return pages


def read(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    return [host.get_data_page(int(indices[i])).view(torch.uint8).clone()
            for i in range(0, indices.numel(), host.page_size)]  # fmt: skip


def backend_for(host: Any, extra: dict[str, Any], **config: Any) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "dynamic", h.storage_config(extra, **config), host
    )
    backend.register_mem_pool_host(host)
    return backend


def test_dynamic_backend_loads_kvd(daemon: DaemonProcess) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from kvd_client.sglang import KvdHiCacheStorage

    host = h.host_pool(h.device_pool(tokens=128, page_size=PAGE), layout="page_first")
    backend = backend_for(host, h.kvd_extra(daemon.endpoint, "dyn"))
    try:
        assert type(backend) is KvdHiCacheStorage and isinstance(backend, HiCacheStorage)
        assert backend.connected and backend.choice.name == "dyn"
        assert backend.choice.layout.slot_bytes == host.size_per_token * PAGE
    finally:
        backend.close()


def test_cache_controller_backup_then_prefetch(daemon: DaemonProcess) -> None:
    """SGLang's HiCacheController: its backup thread stores pages through
    batch_set_v1, its prefetch threads find them (batch_exists) and load them
    (batch_get_v1) into other host pages, byte for byte."""
    device = h.device_pool(tokens=256, page_size=PAGE)
    host = h.host_pool(device, layout="page_first")
    ctl = h.controller(device, host, h.kvd_extra(daemon.endpoint, "ctl"))
    try:
        assert ctl.page_set_func.__name__ == "_page_set_zero_copy"
        tokens = list(range(1000, 1000 + 6 * PAGE))
        keys = h.page_hashes(tokens, PAGE)
        src = host.alloc(len(tokens))
        want = fill(host, src, seed=1)
        ctl.write_storage(src, tokens, hash_value=keys)
        done = ctl.ack_backup_queue.get(timeout=20)
        assert done.completed_tokens == len(tokens)

        op = ctl.prefetch("req-1", tokens)
        hit = ctl.prefetch_hit_queue.get(timeout=20)
        assert hit is op and op.storage_hit_count == len(tokens) and op.hash_value == keys
        op.host_indices = host.alloc(len(tokens))
        ctl.prefetch_buffer.put(op)
        completed = None
        while True:
            ack = ctl.ack_prefetch_queue.get(timeout=20)
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            if ack.completed_req:
                break
        assert completed == len(tokens)
        got = read(host, op.host_indices)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

        # A prompt that shares the first 4 pages: 4 hit, as SGLang asks.
        other = tokens[: 4 * PAGE] + [7] * (2 * PAGE)
        op2 = ctl.prefetch("req-2", other)
        assert ctl.prefetch_hit_queue.get(timeout=20).storage_hit_count == 4 * PAGE
        ctl.terminate_prefetch(op2)
    finally:
        ctl.storage_backend.close()
        ctl.storage_stop_event.set()


@pytest.mark.parametrize(
    ("layout", "mla"),
    [("layer_first", False), ("page_first", False), ("page_first_direct", False),
     ("page_head", False), ("layer_first", True), ("page_first", True)],
)  # fmt: skip
def test_pages_round_trip_in_sglang_flat_format(
    daemon: DaemonProcess, layout: str, mla: bool
) -> None:
    """A slot holds SGLang's flat page: what batch_set_v1 stores, SGLang's copying
    get reads as get_data_page; what set stores, batch_get_v1 loads into place."""
    host = h.host_pool(h.device_pool(tokens=128, page_size=PAGE, mla=mla), layout=layout)
    backend = backend_for(host, h.kvd_extra(daemon.endpoint, f"rt-{layout}-{int(mla)}"), mla=mla)
    try:
        assert backend.choice.layout.replicated is mla
        keys = h.page_hashes(list(range(4 * PAGE)), PAGE)
        src = host.alloc(4 * PAGE)
        want = fill(host, src, seed=2)
        assert backend.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True, True]
        flat = [host.get_dummy_flat_data_page() for _ in range(2)]
        got = backend.batch_get(keys[:2], flat)
        assert all(torch.equal(g.view(torch.uint8), w) for g, w in zip(got, want[:2], strict=True))
        values = [want[2].view(host.dtype), want[3].view(host.dtype)]
        assert backend.batch_set(keys[2:], values)
        assert backend.batch_exists(keys) == 4 and backend.exists(keys[3])
        dst = host.alloc(4 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(read(host, dst), want, strict=True))
        missing = h.page_hashes(list(range(50, 50 + 2 * PAGE)), PAGE)
        assert backend.batch_get_v1([keys[0], *missing], dst[: 3 * PAGE]) == [True, False, False]
    finally:
        backend.close()


def test_daemon_down_misses_within_bound() -> None:
    """No daemon at the endpoint: misses and skipped sets, no exception, each call
    back within the session's timeout."""
    host = h.host_pool(h.device_pool(tokens=128, page_size=PAGE), layout="page_first")
    extra = h.kvd_extra("ipc:///nonexistent/kvd-none.sock", "down", kvd_timeout_ms=200)
    backend = backend_for(host, extra)
    try:
        keys = h.page_hashes(list(range(2 * PAGE)), PAGE)
        idx = host.alloc(2 * PAGE)
        start = time.monotonic()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, idx) == [False, False]
        assert backend.batch_get_v1(keys, idx) == [False, False]
        assert backend.batch_get(keys, [host.get_dummy_flat_data_page()] * 2) == [None, None]
        assert not backend.batch_set(keys, [host.get_dummy_flat_data_page()] * 2)
        assert not backend.exists(keys[0]) and not backend.clear()
        assert backend.get_stats().backup_pgs == []
        assert time.monotonic() - start < 2.0
    finally:
        backend.close()
