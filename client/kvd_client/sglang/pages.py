"""Runs in SGLang's scheduler processes: SGLang's host pool pages as kvd blocks, and the pool.

A kvd block is one SGLang page (`page_size` tokens) of one rank, and its
slot holds the bytes of SGLang's flat data page (`HostKVCache.get_data_page(
index, flat=True)`), so the zero-copy path (`batch_*_v1`) and the copying
one (`get` / `set`, SGLang's flat pages) read and write the same bytes:

    MHA  layer_first   kv_buffer [2, L, size, H, D]   slot: K l0 | K l1 ... | V l0 | V l1 ...
         page_first    kv_buffer [2, size, L, H, D]   slot: K (ps*L*H*D)    | V
         page_first_direct, page_head  [2, pages, ...]   slot: K page        | V page
    MLA  layer_first   kv_buffer [L, size, 1, dim]    slot: l0 | l1 | ...
         page_first    kv_buffer [size, L, 1, dim]    slot: the page
         page_first_direct          [pages, ...]      slot: the page

`page_views` gives those pieces as tensors `[num_pages, piece_bytes]` (one
per piece of the slot, in slot order, every page's piece contiguous), which
is the per-layer form of `kv_caches` that kvd's transfer backends copy
(SPEC section 5): a page of SGLang is a device block to them.

Which pool (`choose_pool`): MLA's KV is the same on every TP rank, so MLA
engines use one replicated pool (`world_size` = TP size, rank 0 writes the
one copy, every rank reads it: SGLang itself backs up from its storage
writer rank only, `HiCacheStorageConfig.is_storage_writer`). MHA's KV is
sharded by head, and SGLang's ranks store independently, from threads that
share no step with each other, while a row of kvd's sharded pool is ready
only once every rank's slot is written through one prepare; so each TP rank
(and pipeline stage, context-parallel rank) of an MHA engine has a pool of
its own, named after its rank. The default name is a digest of what decides
whether two engines' pages are interchangeable: model, dtype, page size,
host layout, page geometry, TP size and rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from kvd_client.errors import BadRequest
from kvd_client.protocol import Layout, valid_pool_name

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def is_mla(host_pool: Any) -> bool:
    """Whether `host_pool` is SGLang's MLA host pool (one latent tensor, no K/V split)."""
    return hasattr(host_pool, "kv_lora_rank")


def page_views(host_pool: Any) -> list[torch.Tensor]:
    """The pieces of every page of `host_pool`, `[num_pages, piece_bytes]` uint8 views.

    `BadRequest` for a layout or pool kind kvd does not map (SGLang's other
    host pools: page_unified, NPU's kv_split, DSA, Mamba state)."""
    layout = host_pool.layout
    if layout not in LAYOUTS or (is_mla(host_pool) and layout == "page_head"):
        raise BadRequest(f"kvd maps SGLang host layouts {', '.join(LAYOUTS)}, not {layout!r}")
    buf = host_pool.kv_buffer
    if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
        raise BadRequest(f"{type(host_pool).__name__}: no CPU kv_buffer tensor to map")
    num_pages = host_pool.size // host_pool.page_size
    parts = [buf] if is_mla(host_pool) else [buf[0], buf[1]]
    if not is_mla(host_pool) and buf.shape[0] != 2:
        raise BadRequest(f"{type(host_pool).__name__}: kv_buffer {tuple(buf.shape)} is not K, V")
    views: list[torch.Tensor] = []
    for part in parts:
        layers = list(part) if layout == "layer_first" else [part]
        for t in layers:
            if not t.is_contiguous():
                raise BadRequest(f"{type(host_pool).__name__}: a {layout} piece is not contiguous")
            views.append(t.reshape(num_pages, -1).view(torch.uint8))
    return views


def page_bytes(host_pool: Any) -> int:
    """Bytes of one page of this rank, all pieces (a slot's `slot_bytes`)."""
    return int(host_pool.size_per_token) * int(host_pool.page_size)


@dataclass(frozen=True, slots=True)
class PoolChoice:
    name: str
    layout: Layout
    rank: int  # this process's rank in `layout` (its slot)
    writer: bool  # whether this rank stores (replicated pools: rank 0 only)
    capacity_bytes: int | None  # None: the daemon's default pool size
    endpoint: str | None


def choose_pool(storage_config: Any, host_pool: Any) -> PoolChoice:
    """The pool for SGLang's `HiCacheStorageConfig` and registered host pool."""
    extra = dict(storage_config.extra_config or {})
    replicated = bool(storage_config.is_mla_model)
    tp_size, tp_rank = int(storage_config.tp_size), int(storage_config.tp_rank)
    sharded = {n: int(getattr(storage_config, f"{n}_size", 1) or 1) for n in ("dcp", "attn_cp")}
    if replicated and any(size > 1 for size in sharded.values()):
        # Each DCP / context-parallel rank holds another shard of the MLA KV (SGLang
        # makes it a writer, and its file backend a key of its own): one replicated
        # pool would serve one shard's bytes to every rank.
        raise BadRequest(
            f"MLA with decode or attention context parallelism ({sharded}) is not "
            "supported by kvd's SGLang backend: run without it, or without kvd"
        )
    where = (
        f"pp={storage_config.pp_rank}/{storage_config.pp_size};"
        f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size};"
        f"dp={storage_config.dp_rank}"
    )
    shape = "mla" if is_mla(host_pool) else f"mha;heads={getattr(host_pool, 'head_num', '')}"
    fingerprint = (
        f"sglang-hicache;host_layout={host_pool.layout};{shape};tp={tp_size};"
        + (where if not replicated else f"pp={storage_config.pp_rank}/{storage_config.pp_size}")
        + ("" if replicated else f";rank={tp_rank}")
    )
    layout = Layout(
        model=str(extra.get("kvd_model") or storage_config.model_name or "unnamed"),
        dtype=str(host_pool.dtype).removeprefix("torch."),
        block_tokens=int(host_pool.page_size),
        world_size=tp_size if replicated else 1,
        replicated=replicated,
        slot_bytes=page_bytes(host_pool),
        extra=fingerprint,
    )
    name = extra.get("kvd_pool")
    if name and not replicated and tp_size > 1:
        name = f"{name}-tp{tp_rank}of{tp_size}"
    if name and not valid_pool_name(str(name)):
        raise BadRequest(f"kvd_pool {name!r}: letters, digits, '_' and '-' only")
    capacity = extra.get("kvd_capacity_bytes")
    return PoolChoice(
        name=str(name) if name else default_pool_name(layout),
        layout=layout,
        rank=tp_rank if replicated else 0,
        writer=bool(storage_config.is_storage_writer),
        capacity_bytes=int(capacity) if capacity is not None else None,
        endpoint=extra.get("kvd_endpoint") or None,
    )


def default_pool_name(layout: Layout) -> str:
    text = repr(
        (layout.model, layout.dtype, layout.block_tokens, layout.world_size,
         layout.replicated, layout.slot_bytes, layout.extra)
    )  # fmt: skip
    return "sglang-" + hashlib.sha256(text.encode()).hexdigest()[:16]
