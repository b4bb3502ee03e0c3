"""Runs in the daemon: the KV events' wire types (vLLM 0.32's form, the older arrays) and framing.

vLLM 0.32 (`vllm/distributed/kv_events.py`) encodes each event as a tagged
*map*, the tag under "type", fields that hold their default left out; the
batch around them stays a positional array:

    KVEventBatch = [ts, [event, ...], data_parallel_rank]
    BlockStored  = {"type": "BlockStored", "block_hashes", "parent_block_hash",
                    "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    then, only when set: "extra_keys", "group_idx",
                    "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality", "ownership", "session_id"}
    BlockRemoved = {"type": "BlockRemoved", "block_hashes", "medium",
                    then, only when set: "group_idx", "locality", "ownership",
                    and kvd's "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

The field order and defaults below are vLLM's, so a store's bytes are the
bytes a vLLM 0.32 publisher would send for the same event. A removal also
names its group's kind (and window), which vLLM's `BlockRemoved` has no field
for: vLLM's decoder ignores a map key it does not know (msgspec's default),
llm-d reads only the fields it names, and Dynamo reads them by name and keeps
a removal of a group other than 0 only when it names a main-attention kind
(`lib/kv-router/src/zmq_wire/filter.rs`, `should_ignore`).

The array form (`events_format = "array"`) is the positional layout vLLM used
before the change, for readers that still unpack positions:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
     lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
     kv_cache_spec_sliding_window]
    ["BlockRemoved", block_hashes, medium, group_idx, kv_cache_spec_kind,
     kv_cache_spec_sliding_window]
    ["AllBlocksCleared"]

It stops there on purpose: Dynamo reads the trailing elements of an array
without their names, a string as a spec kind and a number as a group index
(its `zmq_wire/README.md` documents exactly this tail for both events), so a
"LOCAL" or an ownership after them would be read as a kind and the event
lost. msgspec ignores trailing elements an older array type lacks.

What a kvd pool knows and what it fills in:

- `block_hashes`: what vLLM itself publishes for the key. A 36-byte key (an
  offload key) gives its 32-byte block hash, without the group bytes; an
  8-byte key is a hash already. With `events_int_hashes` (vLLM's default,
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) such a hash is published as
  vLLM's `maybe_convert_block_hash` does: the unsigned big-endian int of its
  bytes, low 64 bits. Keys of other lengths stay bytes.
- `group_idx`: taken from a 36-byte key, which is vLLM's offload key (a
  32-byte block hash followed by the KV-cache group as 4 bytes, big-endian).
  Keys from different groups go in separate events, in key order. Other key
  lengths carry no group, so the field is left out, and so is the kind.
- `kv_cache_spec_kind`, `kv_cache_spec_sliding_window`: the group's entry in
  the pool's `Layout.groups` (vLLM's `KVCacheSpecKind` value, and the window
  of a sliding-window group), as vLLM's `get_offloading_event_group_spec`
  names them. Left out when the layout names no groups (an older client, the
  tools: what kvd published before the layout named them) and for a group
  index past the layout's groups: naming a kind kvd was not told would have a
  router index blocks as a kind they are not; without one a router applies
  its rule for an unclassified group, as for vLLM's own placeholder events.
- `medium`: the index event's, "CPU". `locality` and `ownership`: left out
  (None), as vLLM's OffloadingConnector publishes its CPU tier: its
  `CPUOffloadingManager` makes `OffloadingEvent(keys, Medium.CPU, removed)`
  with neither set, and `OffloadingEventsTracker` forwards them as they are
  (vLLM 0.32 and 0.33, `distributed/kv_transfer/kv_connector/v1/offloading/
  events.py`). A disk tier's blocks (SPEC 16): "STORAGE" and locality
  "LOCAL", what vLLM's fs tier publishes for a local disk
  (`tiering/fs/manager.py`, `Medium.STORAGE`, its configured locality); the
  array form has no locality field. `block_size`: the pool's tokens per block.
- Left at their defaults, because the daemon never sees them:
  `parent_block_hash`, `token_ids` (empty), `lora_id`, `lora_name`,
  `extra_keys` and `session_id` (an engine session is not a vLLM request).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from kvd_client.protocol import Group
from kvd_client.types import OffloadingEvent

EventFormat = Literal["map", "array"]
ExternalBlockHash = bytes | int
_LOW_64_BITS = (1 << 64) - 1
OFFLOAD_KEY_BYTES = 36  # vLLM's offload key: the block hash, then 4 bytes of group
_GROUP_BYTES = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


# omit_defaults never trims an array-like struct: a batch is [ts, events, None],
# three elements, as vLLM's own are.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# -- vLLM 0.32: tagged maps -------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, frozen=True, tag=True):
    """Base of the map-form events; the tag is the class name, under "type"."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    # kvd's, after vLLM's fields (module docstring): Dynamo needs the kind.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """Every block of the pool is gone (start, reset, drop)."""


class KVEventBatch(EventBatch, frozen=True):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# -- before vLLM 0.32: tagged positional arrays -----------------------------------


class ArrayEvent(msgspec.Struct, array_like=True, gc=False, frozen=True, tag=True):
    """Base of the array-form events; every field is always sent, in order."""


class ArrayBlockStored(ArrayEvent, frozen=True, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(ArrayEvent, frozen=True, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayAllBlocksCleared(ArrayEvent, frozen=True, tag="AllBlocksCleared"):
    """Every block of the pool is gone (start, reset, drop)."""


class ArrayEventBatch(EventBatch, frozen=True):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


WireEvent = (
    BlockStored
    | BlockRemoved
    | AllBlocksCleared
    | ArrayBlockStored
    | ArrayBlockRemoved
    | ArrayAllBlocksCleared
)


# -- index events to wire events --------------------------------------------------


def block_hash(key: bytes, as_int: bool) -> ExternalBlockHash:
    """The event block hash vLLM publishes for `key` (module docstring)."""
    digest = key[:-_GROUP_BYTES] if len(key) == OFFLOAD_KEY_BYTES else key
    if as_int and len(key) in (8, OFFLOAD_KEY_BYTES):
        return int.from_bytes(digest, "big") & _LOW_64_BITS
    return digest


def block_hashes(keys: Sequence[bytes], as_int: bool) -> list[ExternalBlockHash]:
    return [block_hash(k, as_int) for k in keys]


def group_of(key: bytes) -> int | None:
    """The KV-cache group of a vLLM offload key (36 bytes); None for other keys."""
    if len(key) != OFFLOAD_KEY_BYTES:
        return None
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


def group_runs(keys: Sequence[bytes]) -> list[tuple[int | None, list[bytes]]]:
    """The keys cut into runs of one group each, order kept: one event names one group."""
    runs: list[tuple[int | None, list[bytes]]] = []
    for key in keys:
        group = group_of(key)
        if runs and runs[-1][0] == group:
            runs[-1][1].append(key)
        else:
            runs.append((group, [key]))
    return runs


GroupSpec = tuple[str | None, int | None]  # (kv_cache_spec_kind, kv_cache_spec_sliding_window)
_NO_SPEC: GroupSpec = (None, None)


def group_spec(groups: Sequence[Group], group: int | None) -> GroupSpec:
    """The kind and window the events of `group` carry: its entry in the pool's
    layout; none for no group or one the layout does not name (module docstring)."""
    if group is None or group >= len(groups):
        return _NO_SPEC
    g = groups[group]
    return g.kind, g.sliding_window


def map_events(
    event: OffloadingEvent, int_block_hashes: bool = False, groups: Sequence[Group] = ()
) -> list[WireEvent]:
    """vLLM 0.32's events for one index event of a pool whose layout names
    `groups`. The daemon never sees tokens, so `token_ids` is empty and
    `parent_block_hash` is None."""
    out: list[WireEvent] = []
    for group, keys in group_runs(event.keys):
        hashes = block_hashes(keys, int_block_hashes)
        kind, window = group_spec(groups, group)
        if event.removed:
            out.append(
                BlockRemoved(
                    hashes,
                    event.medium,
                    group_idx=group,
                    locality=event.locality,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
            )
        else:
            out.append(
                BlockStored(
                    hashes,
                    None,
                    [],
                    event.block_tokens,
                    None,
                    event.medium,
                    None,
                    group_idx=group,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                    locality=event.locality,
                )
            )
    return out


def array_events(
    event: OffloadingEvent, int_block_hashes: bool = False, groups: Sequence[Group] = ()
) -> list[WireEvent]:
    """The same events in the array form."""
    out: list[WireEvent] = []
    for group, keys in group_runs(event.keys):
        hashes = block_hashes(keys, int_block_hashes)
        kind, window = group_spec(groups, group)
        if event.removed:
            out.append(ArrayBlockRemoved(hashes, event.medium, group, kind, window))
        else:
            stored = ArrayBlockStored(
                hashes, None, [], event.block_tokens, None, event.medium, None, None,
                group, kind, window,
            )  # fmt: skip
            out.append(stored)
    return out


ToWire = Callable[[OffloadingEvent, bool, Sequence[Group]], list[WireEvent]]
TO_WIRE: dict[str, ToWire] = {"map": map_events, "array": array_events}
ALL_CLEARED: dict[str, WireEvent] = {"map": AllBlocksCleared(), "array": ArrayAllBlocksCleared()}


def to_wire(
    event: OffloadingEvent,
    int_block_hashes: bool = False,
    event_format: EventFormat = "map",
    groups: Sequence[Group] = (),
) -> list[WireEvent]:
    """The wire events for one index event, in `event_format`."""
    return TO_WIRE[event_format](event, int_block_hashes, groups)


# -- framing ------------------------------------------------------------------


def format_topic(topic_format: str, hostname: str, pool: str) -> bytes:
    return topic_format.format(hostname=hostname, pool=pool).encode()


def parse_replay_request(frames: Sequence[bytes]) -> tuple[list[bytes], int | None]:
    """Splits `[identity, *envelope, body]` (identity already removed) into the
    envelope to echo and the start sequence; None when the body is not 8 bytes."""
    cut = 0
    for i, frame in enumerate(frames):
        if not frame:
            cut = i + 1
            break
    envelope, body = list(frames[:cut]), frames[cut:]
    if len(body) != 1 or len(body[0]) != 8:
        return envelope, None
    return envelope, int.from_bytes(body[0], "big")
