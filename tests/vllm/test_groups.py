"""Runs in the test process: KV cache groups in `KvdOffloadingSpec` against a real daemon (no engine).

Keys are vLLM's (`make_offload_key`: the block hash, then the group in 4
bytes). vLLM's connector asks a full-attention group key by key from its
first key on, and a sliding-window group from its last key back
(`_sliding_window_lookup`); these tests ask in that order.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)

from kvd_client.vllm import KvdOffloadingSpec
from kvd_client.vllm.manager import UNSERVABLE
from kvd_client.vllm.pool import choose_pool
from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.offload_config import offloading_config as config

HIT, MISS = LookupResult.HIT, LookupResult.MISS
GEMMA_LIKE = [["full_attention", 32, None], ["sliding_window", 32, 64]]
HASHES = [bytes([i + 1]) * 32 for i in range(8)]
FULL = [make_offload_key(h, 0) for h in HASHES]
SLIDING = [make_offload_key(h, 1) for h in HASHES]


def store(manager: Any, keys: list[bytes]) -> None:
    ctx = ReqContext("writer")
    out = manager.prepare_store(keys, ctx)
    assert out is not None and len(out.keys_to_store) == len(keys)
    manager.on_copies({out.store_spec.token: (1, True)})  # its one worker copied it
    manager.complete_store(keys, ctx)


def reader() -> ReqContext:
    ctx = ReqContext("reader")
    for i, (full, sliding) in enumerate(zip(FULL, SLIDING, strict=True)):
        ctx.set_offload_key_position(full, (i + 1) * 32)
        ctx.set_offload_key_position(sliding, (i + 1) * 32)
    return ctx


@pytest.mark.parametrize("table", [True, False])
def test_each_group_is_looked_up_by_its_kind(table: bool) -> None:
    """The full group: every block a prefix hit. The sliding group, stored (as vLLM
    stores it) only where a load can reach, chunks 1-3 and 7: scanning back from
    chunk 7, each key is answered for itself, past the misses of 4-6: from the
    ready table (no message), or over round trips, one a group and step and one
    for each miss the scan goes past (`SCAN_TRIPS` at most)."""
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(config(groups=2, kvd_endpoint=d.endpoint, kvd_pool="g",
                                        kvd_groups=GEMMA_LIKE, kvd_ready_table=table))  # fmt: skip
        manager = spec.get_manager()
        store(manager, FULL + [SLIDING[i] for i in (1, 2, 3, 7)])
        ctx = reader()
        assert [manager.lookup(k, ctx) for k in FULL] == [HIT] * 8  # type: ignore[arg-type]
        back = [manager.lookup(SLIDING[i], ctx) for i in range(7, -1, -1)]  # type: ignore[arg-type]
        assert back == [HIT, MISS, MISS, MISS, HIT, HIT, HIT, MISS]
        # vLLM loads the full group's prefix and the sliding group's last chunk.
        spec_ = manager.prepare_load([*FULL, SLIDING[7]], ctx)  # type: ignore[arg-type]
        assert spec_.generation != UNSERVABLE and len(spec_.block_ids) == 9  # type: ignore[attr-defined]
        manager.complete_load([*FULL, SLIDING[7]], ctx)  # type: ignore[arg-type]
        manager.on_request_finished(ctx)
        manager.shutdown()


def test_engines_of_other_groups_never_share_a_pool(caplog: pytest.LogCaptureFixture) -> None:
    one = choose_pool(config(kvd_groups=[["full_attention", 32, None]]))
    assert one.layout.groups[0].kind == "full_attention"
    hybrid = choose_pool(config(groups=2, kvd_groups=GEMMA_LIKE))
    window = choose_pool(config(groups=2, kvd_groups=[GEMMA_LIKE[0], ["sliding_window", 32, 128]]))
    assert len({one.name, hybrid.name, window.name}) == 3  # default names differ
    with DaemonProcess() as d:  # named alike, the second is refused: offloading off
        first = KvdOffloadingSpec(config(groups=2, kvd_endpoint=d.endpoint, kvd_pool="p",
                                         kvd_groups=GEMMA_LIKE, kvd_ready_table=False))  # fmt: skip
        store(first.get_manager(), [FULL[0]])
        other = KvdOffloadingSpec(config(groups=2, kvd_endpoint=d.endpoint, kvd_pool="p",
                                         kvd_groups=[GEMMA_LIKE[0], ["sliding_window", 32, 128]],
                                         kvd_ready_table=False))  # fmt: skip
        manager = other.get_manager()
        ctx = reader()
        assert manager.lookup(FULL[0], ctx) is MISS  # type: ignore[arg-type]
        assert any("LAYOUT_MISMATCH" in r.getMessage() for r in caplog.records)
        first.get_manager().shutdown()
        manager.shutdown()


def test_a_chunk_of_two_blocks_of_two_groups_round_trips() -> None:
    """blocks_per_chunk 2, two groups in two tensors: group 0's first block is the
    second of its chunk (block_indices 1), group 1's starts a chunk. Each group's
    blocks come back where vLLM asks, with every tensor's page of the block (vLLM's
    groups share one block pool: a page of a tensor its group does not use is
    nobody's), and no other block is written."""
    a = torch.zeros((16, 4096), dtype=torch.int8)
    b = torch.zeros((16, 4096), dtype=torch.int8)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(a, 4096), CanonicalKVCacheTensor(b, 4096)],
        [[CanonicalKVCacheRef(0, 4096)], [CanonicalKVCacheRef(1, 4096)]],
    )
    for i in range(16):
        a[i], b[i] = i + 1, -(i + 1)
    was_a, was_b = a.clone(), b.clone()
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(config(groups=2, blocks_per_chunk=2, bytes_per_block=8192,
                                        kvd_endpoint=d.endpoint, kvd_groups=GEMMA_LIKE))  # fmt: skip
        manager, worker = spec.get_manager(), spec.get_worker(caches)
        keys = [FULL[0], FULL[1], SLIDING[0]]  # two chunks of group 0, one of group 1
        ctx = ReqContext("writer")
        out = manager.prepare_store(keys, ctx)  # type: ignore[arg-type]
        assert out is not None
        assert worker.submit_store(1, GPULoadStoreSpec([3, 4, 5, 7, 8], (3, 2), (1, 0)),
                                   out.store_spec)  # fmt: skip
        worker.wait({1})  # the copy is asynchronous; vLLM reports it, then the copies
        assert [r.job_id for r in worker.get_finished()] == [1]
        copies = worker.take_copies()  # type: ignore[attr-defined]
        manager.on_copies({token: (1, done) for token, done in copies.items()})  # type: ignore[attr-defined]
        manager.complete_store(keys, ctx)  # type: ignore[arg-type]
        a.zero_()
        b.zero_()
        read = reader()
        src = manager.prepare_load(keys, read)  # type: ignore[arg-type]
        assert worker.submit_load(2, src, GPULoadStoreSpec([10, 11, 12, 13, 14], (3, 2), (1, 0)))
        worker.wait({2})
        assert [r.job_id for r in worker.get_finished()] == [2]
        assert worker.take_failed_loads() == set()  # type: ignore[attr-defined]
        for t, was in ((a, was_a), (b, was_b)):
            assert torch.equal(t[10:15], was[[3, 4, 5, 7, 8]])
            assert not t[:10].any() and not t[15:].any()
        manager.complete_load(keys, read)  # type: ignore[arg-type]
        worker.shutdown()
        manager.shutdown()
