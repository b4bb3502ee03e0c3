"""Runs in the tests' and `kvd bench vllm`'s processes: a vLLM `OffloadingConfig`, no engine.

Built field by field, as vLLM's own tests build one (`vllm/v1/kv_offload/config.py`):
one KV cache group of 32-token blocks and 4096 bytes a block unless told otherwise.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)


def offloading_config(
    *,
    groups: int = 1,
    world_size: int = 1,
    replicated: bool = False,
    blocks_per_chunk: int = 1,
    model: str = "tiny-llama",
    bytes_per_block: int = 4096,
    events: bool = False,
    **extra: Any,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(32, (f"layers.{g}",), g) for g in range(groups)
        ),
        worker_kv_bytes_per_block=bytes_per_block,
        enable_kv_cache_events=events,
        # kvd_connector: what KvdOffloadingConnector sets (False: vLLM's plain connector)
        extra_config={"spec_name": "KvdOffloadingSpec", "spec_module_path": "kvd_client.vllm",
                      "kvd_connector": True, **extra},
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
