"""Runs in the test process: `KvdOffloadingSpec` on configs built as vLLM builds them (no engine)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvd_client.vllm import KvdOffloadingSpec
from kvd_client.vllm.pool import choose_pool
from kvd_tools.launcher import DaemonProcess


def config(
    *,
    groups: int = 1,
    world_size: int = 1,
    replicated: bool = False,
    blocks_per_chunk: int = 1,
    model: str = "tiny-llama",
    **extra: Any,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(32, (f"layers.{g}",), g) for g in range(groups)
        ),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "KvdOffloadingSpec", "spec_module_path": "kvd_client.vllm",
                      **extra},
        engine_id="engine-0",
        model=OffloadingModelConfig(model, "bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
            dcp_size=1, data_parallel_index=0, data_parallel_size=1,
            data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated,
        kv_cache_layout="NHD",
    )  # fmt: skip


def test_the_default_pool_follows_what_makes_blocks_interchangeable() -> None:
    base = choose_pool(config())
    assert base.name == choose_pool(config()).name  # stable
    assert base.layout.slot_bytes == 4096 and base.layout.block_tokens == 32
    for other in (
        config(model="other"),
        config(world_size=2),
        config(world_size=2, replicated=True),
        config(blocks_per_chunk=2),
    ):
        assert choose_pool(other).name != base.name
    named = choose_pool(config(kvd_pool="shared", kvd_capacity_bytes=1 << 20))
    assert (named.name, named.capacity_bytes) == ("shared", 1 << 20)


def test_the_replicated_layout_maps_to_a_replicated_pool() -> None:
    spec = KvdOffloadingSpec(config(world_size=2, replicated=True))
    assert spec.replicated_layout
    assert spec.choice.layout.replicated and spec.choice.layout.world_size == 2


@pytest.mark.parametrize(
    ("cfg", "why"),
    [
        (config(groups=2), "2 KV cache groups"),
        (config(blocks_per_chunk=2), "blocks_per_chunk 2"),
    ],
)
def test_what_kvd_cannot_hold_turns_offloading_off_with_one_line(
    cfg: OffloadingConfig, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = KvdOffloadingSpec(cfg).get_manager()
    ctx = ReqContext("r")
    assert manager.lookup(b"k" * 36, ctx) is LookupResult.MISS  # type: ignore[arg-type]
    assert manager.prepare_store([b"k" * 36], ctx) is None  # type: ignore[list-item]
    (line,) = [r.getMessage() for r in caplog.records if "kvd offloading off" in r.getMessage()]
    assert line.startswith(f"kvd offloading off for this engine: {why}")


def test_an_explicit_pool_with_another_layout_is_off_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with DaemonProcess() as d:
        first = KvdOffloadingSpec(config(kvd_endpoint=d.endpoint, kvd_pool="p"))
        assert first.get_manager().prepare_store([b"a" * 36], ReqContext("r")) is not None
        other = KvdOffloadingSpec(config(kvd_endpoint=d.endpoint, kvd_pool="p", world_size=2))
        manager = other.get_manager()
        assert manager.lookup(b"a" * 36, ReqContext("r")) is LookupResult.MISS  # type: ignore[arg-type]
        assert any("LAYOUT_MISMATCH" in r.message for r in caplog.records)
        first.get_manager().shutdown()
        manager.shutdown()
