"""Runs in the test process: what llm-d's indexer and Dynamo's router do with a KV-event payload.

Written in Python from reading their Go and Rust code, not copied from it;
each rule names where it is. They read the raw msgpack (no kvd or vLLM types),
as those routers do.

llm-d: github.com/llm-d/llm-d-router at ebab687927f5331c1b39defcb579a07951bce56c
(2026-08-22), `pkg/kvevents/engineadapter/vllm_adapter.go` (map events to
positions by `blockStoredFieldOrder` / `blockRemovedFieldOrder`),
`engineadapter/common.go` (`getHashAsUint64`: an int as it is, bytes by their
last 8 bytes big-endian), `pkg/kvevents/pool.go` (`processEventBatch`,
`blockStoredEventDigestible`, `isPrefixIndexableSpecKind`,
`handleDeviceTierUpdate`, `normalizeDeviceTier`), `pkg/kvcache/kvblock/
in_memory.go` (`GetRequestKey`: the engine key's last request key).

Dynamo: github.com/ai-dynamo/dynamo, `lib/kv-router/src/zmq_wire/`:
`mod.rs` at 035d7262edb1b407b2c9de5116b47321b08c751a (`ZmqEventNormalizer`:
`learn_metadata` from stores only, `filter_reason`), `filter.rs` at
17b173e9b99d87142d835e81fbfa54f681a70f2e (`is_main_attention`), `types.rs`
and `deserialize.rs` at 4fb5a208fe6ecd1a8752e933f1e9eabd0931f223
(`BlockHashValue` is an i64 or u64: bytes hashes fail the batch), `convert.rs`
at 2bd0a36dcb371b2f22ad56aa48215e383aee02a0 (a REMOTE or unknown locality is
dropped; `create_stored_blocks` publishes a block only when its `block_size`
is the router's and `token_ids` cover it).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

_LLMD_STORED = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
]  # fmt: skip
_LLMD_REMOVED = ["block_hashes", "medium", "group_idx"]
_LLMD_PREFIX_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}
_DYNAMO_MAIN_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}
_DYNAMO_KINDS = _DYNAMO_MAIN_KINDS | {
    "sliding_window", "sliding_window_mla", "mamba", "chunked_local_attention",
    "encoder_only_attention", "cross_attention",
}  # fmt: skip


def _events(payload: bytes) -> list[Any]:
    ts, events, *_ = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float)
    return list(events)


def _positions(ev: dict[str, Any] | list[Any]) -> list[Any]:
    """vllm_adapter.go `mapEventToFields`: a map event as the positions an array has."""
    if isinstance(ev, list):
        return ev
    tag = ev["type"]
    order = {"BlockStored": _LLMD_STORED, "BlockRemoved": _LLMD_REMOVED}.get(tag, [])
    return [tag, *(ev.get(name) for name in order)]


def _llmd_hash(raw: int | bytes) -> int:
    """common.go `getHashAsUint64`."""
    if isinstance(raw, int):
        return raw & ((1 << 64) - 1)
    return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")


def request_keys(parent: int, tokens: list[int], block_size: int) -> list[int]:
    """Stands in for llm-d's token processor: one chained key per full block."""
    keys = []
    for i in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha256(repr((parent, tokens[i : i + block_size])).encode()).digest()
        parent = int.from_bytes(digest[:8], "big")
        keys.append(parent)
    return keys


@dataclass
class LlmdIndex:
    """llm-d's `Pool.processEventBatch` over an in-memory index."""

    block_size: int = 16
    catalog: dict[tuple[str, int], tuple[str, int | None]] = field(default_factory=dict)
    engine_to_request: dict[int, list[int]] = field(default_factory=dict)
    # request key -> {(pod, device tier, group or None)}
    entries: dict[int, set[tuple[str, str, int | None]]] = field(default_factory=dict)
    skipped: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # blocks

    def feed(self, topic: bytes, payload: bytes) -> None:
        pod = topic.decode().split("@")[1]  # common.go parseTopic: kv@<pod>@<model>
        for ev in _events(payload):
            f = _positions(ev)
            if f[0] == "BlockStored":
                self._stored(pod, f + [None] * (12 - len(f)))
            elif f[0] == "BlockRemoved":
                self._removed(pod, f + [None] * (4 - len(f)))
            elif f[0] == "AllBlocksCleared":
                for pods in self.entries.values():
                    pods.difference_update({e for e in pods if e[0] == pod})

    def _stored(self, pod: str, f: list[Any]) -> None:
        hashes = [_llmd_hash(h) for h in f[1]]
        tokens, size, tier = list(f[3]), int(f[4]), (f[6] or "gpu").lower()
        group, kind, window = f[9], f[10] or "", f[11]
        if group is not None:
            if not kind:
                kind = self.catalog.get((pod, group), ("", None))[0]
            else:
                self.catalog[(pod, group)] = (kind, window)
            if kind not in _LLMD_PREFIX_KINDS:  # blockStoredEventDigestible
                self.skipped["store", kind or "unknown", "unsupported_cache_kind"] += len(hashes)
                return
        entry = (pod, tier, group)
        parent = 0
        if f[2] is not None:  # GetRequestKey: an unknown parent skips the event
            if _llmd_hash(f[2]) not in self.engine_to_request:
                self.skipped["store", kind or "none", "unknown_parent"] += len(hashes)
                return
            parent = self.engine_to_request[_llmd_hash(f[2])][-1]
        keys = request_keys(parent, tokens, self.block_size)
        if not keys:  # handleDeviceTierUpdate: resolve the engine keys another pod mapped
            if tokens or not hashes:
                return
            known = [self.engine_to_request[h][-1] for h in hashes if h in self.engine_to_request]
            for rk in known:
                self.entries.setdefault(rk, set()).add(entry)
            return
        # Index.Add: engine keys to request keys, 1:1 at the canonical block size.
        assert size == self.block_size and len(keys) == len(hashes)
        for h, rk in zip(hashes, keys, strict=True):
            self.engine_to_request.setdefault(h, []).append(rk)
            self.entries.setdefault(rk, set()).add(entry)

    def _removed(self, pod: str, f: list[Any]) -> None:
        tier, group = (f[2] or "gpu").lower(), f[3]
        if group is not None:
            meta = self.catalog.get((pod, group))
            if meta is None or meta[0] not in _LLMD_PREFIX_KINDS:
                kind = "unknown" if meta is None else meta[0]
                reason = "unknown_group" if meta is None else "unsupported_cache_kind"
                self.skipped["remove", kind, reason] += len(f[1])
                return
        for h in (_llmd_hash(x) for x in f[1]):
            for rk in self.engine_to_request.get(h, []):
                self.entries.get(rk, set()).discard((pod, tier, group))

    def holders(self, engine_hash: int) -> set[tuple[str, str, int | None]]:
        """Who holds the block an engine key names (the request keys it maps to)."""
        rks = self.engine_to_request.get(engine_hash, [])
        return {e for rk in rks for e in self.entries.get(rk, set())}


@dataclass
class DynamoRouter:
    """Dynamo's `ZmqEventNormalizer` (one per worker) and `convert_event`, over
    an index of external block hashes per storage medium."""

    kv_block_size: int = 16
    groups: dict[int, str] = field(default_factory=dict)  # learned from stores only
    filtered: Counter[tuple[str, str]] = field(default_factory=Counter)  # blocks
    stored: dict[str, set[int]] = field(default_factory=dict)
    passed: list[tuple[str, list[int], int | None]] = field(default_factory=list)
    removed: dict[str, list[int]] = field(default_factory=dict)

    def feed(self, payload: bytes) -> None:
        for ev in _events(payload):
            assert isinstance(ev, dict), "map events only here"
            tag = ev["type"]
            if tag == "AllBlocksCleared":
                self.stored.clear()
                continue
            # deserialize.rs: BlockHashValue is an i64 or a u64, nothing else.
            hashes = ev["block_hashes"]
            assert all(isinstance(h, int) for h in hashes), "Dynamo cannot decode bytes hashes"
            hashes = [h & ((1 << 64) - 1) for h in hashes]
            group, kind = ev.get("group_idx"), ev.get("kv_cache_spec_kind")
            if kind is not None and kind not in _DYNAMO_KINDS:
                kind = "unknown"
            if tag == "BlockStored" and group is not None and kind is not None:
                self.groups[group] = kind  # learn_metadata
            reason = self._filter_reason(group, kind)
            if reason is not None:
                self.filtered[tag, reason] += len(hashes)
                continue
            if ev.get("locality") not in (None, "LOCAL"):  # convert.rs: fails closed
                self.filtered[tag, "non_local"] += len(hashes)
                continue
            medium = ev.get("medium") or "GPU"
            self.passed.append((tag, hashes, group))
            if tag == "BlockRemoved":
                self.removed.setdefault(medium, []).extend(hashes)
                self.stored.get(medium, set()).difference_update(hashes)
            else:
                self.stored.setdefault(medium, set()).update(self._blocks(ev, hashes))

    def _filter_reason(self, group: int | None, kind: str | None) -> str | None:
        if kind is not None:
            if kind in _DYNAMO_MAIN_KINDS:
                return None
            return "unknown_kind" if kind == "unknown" else "non_main_attention_kind"
        if group is None:
            return None
        learned = self.groups.get(group)
        if learned is not None:
            if learned in _DYNAMO_MAIN_KINDS:
                return None
            return "unknown_kind" if learned == "unknown" else "non_main_attention_group"
        return None if group == 0 else "unlearned_group_idx"

    def _blocks(self, ev: dict[str, Any], hashes: list[int]) -> list[int]:
        """convert.rs `create_stored_blocks`: a block is published only with its
        tokens, and only at the router's block size; the first that is not stops it."""
        out, offset, tokens = [], 0, ev["token_ids"]
        for h in hashes:
            if ev["block_size"] != self.kv_block_size or offset + self.kv_block_size > len(tokens):
                break
            out.append(h)
            offset += self.kv_block_size
        return out
