"""Runs in vLLM's processes: which kvd pool an engine uses, from vLLM's `OffloadingConfig`.

One kvd block is one vLLM offload chunk (`blocks_per_chunk` device blocks);
a rank's slot holds that chunk's device blocks one after the other, each
block's pages of every canonical KV tensor back to back (`copies`). The
layout names the engine's KV cache groups (`Layout.groups`, from
`kvd_groups`, which `KvdOffloadingConnector` sets). The default pool
name is a digest of everything that decides whether two engines' blocks are
interchangeable (model, KV dtype, tokens per block, parallelism,
replication, slot bytes, page layout and KV cache groups), so engines that
can share a pool do, and engines that cannot never meet in one (no
`LAYOUT_MISMATCH` by accident).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvd_client.protocol import Layout
from kvd_client.vllm.groups import groups_of

DEFAULT_CAPACITY_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class PoolChoice:
    name: str
    layout: Layout
    capacity_bytes: int | None
    endpoint: str | None


def choose_pool(config: Any) -> PoolChoice:
    """The pool, layout and endpoint for vLLM config `config` (an `OffloadingConfig`)."""
    extra = dict(config.extra_config)
    bpc = config.cache.blocks_per_chunk
    tokens = config.groups[0].tokens_per_block * bpc
    world = config.parallel.world_size
    replicated = bool(config.replicated_layout)
    fingerprint = (
        f"vllm-offload;layout={config.kv_cache_layout};canonical={int(config.canonical_layout)};"
        f"groups={len(config.groups)};tp={config.parallel.tp_size};pp={config.parallel.pp_size};"
        f"pcp={config.parallel.pcp_size};dcp={config.parallel.dcp_size};"
        f"weights={extra.get('kvd_weights', '')}"
    )
    if bpc > 1:  # slots of several blocks were tensor-major before: never read as this
        fingerprint += ";slot=block-major"
    layout = Layout(
        model=config.model.name,
        dtype=str(config.model.dtype),
        block_tokens=tokens,
        world_size=world,
        replicated=replicated,
        slot_bytes=config.worker_kv_bytes_per_block * bpc,
        extra=fingerprint,
        groups=groups_of(extra.get("kvd_groups") or ()),
    )
    name = extra.get("kvd_pool") or default_pool_name(layout)
    capacity = extra.get("kvd_capacity_bytes")
    return PoolChoice(
        name=str(name),
        layout=layout,
        capacity_bytes=int(capacity) if capacity is not None else None,
        endpoint=extra.get("kvd_endpoint") or None,
    )


def default_pool_name(layout: Layout) -> str:
    text = repr(
        (layout.model, layout.dtype, layout.block_tokens, layout.world_size,
         layout.replicated, layout.slot_bytes, layout.extra, layout.groups)
    )  # fmt: skip
    return "vllm-" + hashlib.sha256(text.encode()).hexdigest()[:16]
