"""Runs in vLLM's processes: an engine's KV cache groups, as kvd names and looks them up (SPEC 12).

vLLM keys an offloaded block per (block hash, group): `make_offload_key`
appends the group's index in 4 big-endian bytes, so one engine's groups
never share a key. Its connector looks each group up by its kind
(`OffloadingConnectorScheduler._lookup_complete_chunks`, vLLM 0.32):

- a group without a window (full attention, MLA, sink): the longest run of
  hits from the first key it asks about on (`_maximal_prefix_lookup`);
- a group with a window (sliding window, chunked local attention, and
  Mamba, whose one state is a window of one chunk): scanning back from the
  last key of the range it may load for the last run of a window's hits
  (`_sliding_window_lookup`); its stores skip the chunks no load can reach
  (`_reachable_store_block_mask`), so only the last window of a prompt is
  in the pool.

kvd answers a group in the order vLLM asks it (`lookup_order`): the daemon's
lookup counts the leading hits of the keys it is given, so one lookup from
the first key vLLM asks about, forward for a prefix group and backward for
a window group, answers every key of vLLM's scan up to its first miss.

The pool's layout names every group (`Layout.groups`: vLLM's kind, tokens
per device block, window), read from the engine's `KVCacheConfig` by
`KvdOffloadingConnector` (`describe_groups`), so that only engines with the
same groups share a pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvd_client.protocol import Group

# vLLM's `KVCacheSpecKind` values whose groups it looks up scanning back for a
# window (`get_sliding_window_size_in_chunks` is not None for their specs).
WINDOW_KINDS = frozenset(
    {"sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba"}
)
GROUP_BYTES = 4  # the group index at the end of an OffloadKey


def describe_groups(kv_cache_config: Any) -> list[list[Any]]:
    """Every KV cache group of `kv_cache_config` (vLLM's `KVCacheConfig`), in its
    order, as `[kind, tokens per block, window or None]`: what the extra config
    carries to the spec (`groups_of`)."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    described = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = get_kv_cache_spec_sliding_window(spec)
        described.append([get_kv_cache_spec_kind(spec).value, int(spec.block_size), window])
    return described


def groups_of(described: Iterable[Sequence[Any]]) -> tuple[Group, ...]:
    """`Layout.groups` from `describe_groups`' lists."""
    return tuple(
        Group(str(kind), int(tokens), int(window) if window is not None else None)
        for kind, tokens, window in described
    )


def window_groups(groups: Sequence[Group]) -> frozenset[int]:
    """The indices of the groups vLLM looks up scanning back for a window."""
    return frozenset(i for i, g in enumerate(groups) if g.kind in WINDOW_KINDS)


def group_of(key: bytes) -> int:
    """The group index of an OffloadKey (vLLM's `get_offload_group_idx`)."""
    return int.from_bytes(key[-GROUP_BYTES:], "big")


def lookup_order(positions: Mapping[bytes, int], first: bytes, *, window: bool) -> list[bytes]:
    """The keys of `first`'s group to look up, in the order vLLM's scan reads them:
    from `first` to the group's last registered key for a prefix group, from
    `first` back to the group's first key for a window group. `positions` is the
    request's `_offload_key_positions` (every group's keys, by their end token);
    keys before `first` in a prefix group are in vLLM's own cache."""
    if first not in positions:
        return [first]
    suffix = first[-GROUP_BYTES:]
    mine = [k for k in positions if k[-GROUP_BYTES:] == suffix]
    ends = [positions[k] for k in mine]
    if ends != sorted(ends):  # vLLM registers them in prefix order: seldom needed
        mine.sort(key=positions.__getitem__)
    at = mine.index(first)
    return mine[at::-1] if window else mine[at:]
