"""Runs in the test process: the KV-event encoding, read back as its consumers would.

The consumer types below are written from the wire format alone (SPEC section
8: vLLM 0.32's tagged maps, and the older positional arrays that llm-d's
indexer reads), never imported from `kvd.io.event_wire`. vLLM's own decoder
is the test in tests/integration/test_events_vllm.py.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvd.io.event_wire import (
    END_SEQ,
    AllBlocksCleared,
    ArrayAllBlocksCleared,
    EventBatch,
    EventFormat,
    format_topic,
    group_of,
    parse_replay_request,
    to_wire,
)
from kvd_client.protocol import Group
from kvd_client.scheduler import as_keys
from kvd_client.types import OffloadingEvent

# -- consumer types: vLLM 0.32 (tagged maps, defaults omitted) -------------------


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class Stored(MapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class Removed(MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    kv_cache_spec_kind: str | None = None  # kvd's (kvd.io.event_wire)
    kv_cache_spec_sliding_window: int | None = None


class Cleared(MapEvent, tag="AllBlocksCleared"):
    pass


# -- consumer types: the older positional form (int hashes, six fields) ----------


class ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class LegacyStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[LegacyStored | LegacyRemoved | LegacyCleared]


K = [b"\x00" * 7 + b"\x01", b"\xff" * 8, b"a-longer-key-of-20-b"]


def offload_key(block_hash: bytes, group: int) -> bytes:
    """vLLM's offload key: a 32-byte block hash, then the group as 4 bytes."""
    return block_hash + group.to_bytes(4, "big")


def encode(events: list[Any], ts: float = 1.5) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts, events))


def wire(
    event: OffloadingEvent,
    as_int: bool = False,
    fmt: EventFormat = "map",
    groups: tuple[Group, ...] = (),
) -> list[Any]:
    return list(to_wire(event, as_int, fmt, groups))


def test_wire_shape_is_vllm_032_tagged_maps() -> None:
    events = [
        *wire(OffloadingEvent(K[:2], 16)),
        *wire(OffloadingEvent(K[2:], 16, removed=True)),
        AllBlocksCleared(),
    ]
    assert msgspec.msgpack.decode(encode(events)) == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": K[:2],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 16,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": K[2:], "medium": "CPU"},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]


def test_consumer_types_decode_stored_removed_cleared() -> None:
    payload = encode(
        [
            *wire(OffloadingEvent(K, 32)),
            *wire(OffloadingEvent([K[0]], 32, removed=True)),
            AllBlocksCleared(),
        ],
        ts=99.25,
    )
    batch = msgspec.msgpack.Decoder(Batch).decode(payload)
    assert batch.ts == 99.25
    assert batch.data_parallel_rank is None
    assert batch.events == [
        Stored(K, None, [], 32, None, "CPU", None),
        Removed([K[0]], "CPU"),
        Cleared(),
    ]


def test_group_idx_from_vllm_offload_keys_one_event_per_group() -> None:
    a, b, c = (offload_key(bytes([i]) * 32, g) for i, g in ((1, 0), (2, 0), (3, 2)))
    assert [group_of(k) for k in (a, c, K[0], K[2], a[:35])] == [0, 2, None, None, None]
    # Key order is kept; a change of group (or a key without one) starts a new event.
    events = wire(OffloadingEvent([a, b, c, K[0], a], 16), as_int=True)
    decoded = msgspec.msgpack.Decoder(Batch).decode(encode(events)).events
    # vLLM's int hash of an offload key: its block hash, low 64 bits, big-endian.
    h1, h2, h3 = (int.from_bytes(bytes([i]) * 8, "big") for i in (1, 2, 3))
    assert [(e.block_hashes, e.group_idx) for e in decoded if isinstance(e, Stored)] == [
        ([h1, h2], 0),
        ([h3], 2),
        ([1], None),  # an 8-byte key: no group, and an int hash
        ([h1], 0),
    ]
    removed = wire(OffloadingEvent([c, a], 16, removed=True))
    assert (
        msgspec.msgpack.decode(encode(removed))[1]
        == [
            {
                "type": "BlockRemoved",
                "block_hashes": [c[:32]],  # bytes hashes: the block hash, no group bytes
                "medium": "CPU",
                "group_idx": 2,
            },
            {
                "type": "BlockRemoved",
                "block_hashes": [a[:32]],
                "medium": "CPU",
                "group_idx": 0,
            },
        ]
    )


HYBRID = (Group("sliding_window", 16, 1024), Group("full_attention", 16))


@pytest.mark.parametrize("fmt", ["map", "array"])
def test_each_group_carries_its_layouts_kind_and_window(fmt: EventFormat) -> None:
    sw, full, past = (offload_key(bytes([i]) * 32, g) for i, g in ((1, 0), (2, 1), (3, 2)))
    keys = [sw, full, past, K[0]]
    events = [
        *wire(OffloadingEvent(keys, 16), True, fmt, HYBRID),
        *wire(OffloadingEvent(keys, 16, removed=True), True, fmt, HYBRID),
    ]
    decoded = msgspec.msgpack.decode(encode(events))[1]
    if fmt == "map":
        got = [
            (e["type"], e.get("group_idx"), e.get("kv_cache_spec_kind"),
             e.get("kv_cache_spec_sliding_window"), e.get("locality"), e.get("ownership"))
            for e in decoded
        ]  # fmt: skip
    else:  # [9] group, [10] kind, [11] window; a removal's [3], [4], [5]
        at = {"BlockStored": 9, "BlockRemoved": 3}
        got = [(e[0], *e[at[e[0]] : at[e[0]] + 3], None, None) for e in decoded]
    expected = [
        ("sliding_window", 0, "sliding_window", 1024),
        ("full_attention", 1, "full_attention", None),
        # A group the layout does not name: its index, and no kind.
        ("past", 2, None, None),
        ("no group", None, None, None),  # an 8-byte key: neither
    ]
    assert got == [
        (tag, group, kind, window, None, None)  # never a locality or an ownership
        for tag in ("BlockStored", "BlockRemoved")
        for _, group, kind, window in expected
    ]


def test_a_layout_without_groups_publishes_the_group_and_no_kind() -> None:
    """An older client's pool: what kvd published before layouts named groups."""
    keys = [offload_key(b"\x01" * 32, 0), offload_key(b"\x02" * 32, 1)]
    for removed in (False, True):
        decoded = msgspec.msgpack.decode(encode(wire(OffloadingEvent(keys, 16, removed=removed))))
        assert [(e["group_idx"], "kv_cache_spec_kind" in e) for e in decoded[1]] == [
            (0, False),
            (1, False),
        ]


def test_array_form_is_the_positional_layout_of_older_vllm() -> None:
    g1 = offload_key(b"\x07" * 32, 1)
    events = [
        *wire(OffloadingEvent(K[:1], 16), True, "array"),
        *wire(OffloadingEvent([g1], 16, removed=True), True, "array"),
        ArrayAllBlocksCleared(),
    ]
    # The positions llm-d's indexer reads: [0] tag ... [9] group_idx,
    # [10] kv_cache_spec_kind, [11] kv_cache_spec_sliding_window; removal [3] group_idx,
    # then the tail Dynamo's zmq_wire/README.md documents: [4] kind, [5] window.
    assert msgspec.msgpack.decode(encode(events)) == [
        1.5,
        [
            ["BlockStored", [1], None, [], 16, None, "CPU", None, None, None, None, None],
            ["BlockRemoved", [int.from_bytes(b"\x07" * 8, "big")], "CPU", 1, None, None],
            ["AllBlocksCleared"],
        ],
        None,
    ]


def test_array_form_reads_with_the_older_six_field_types() -> None:
    engine_hashes = [1, 2**64 - 5, 123456789]
    keys = as_keys(engine_hashes)
    events = [
        *wire(OffloadingEvent(keys, 16), True, "array"),
        *wire(OffloadingEvent(keys[:1], 16, removed=True), True, "array"),
        ArrayAllBlocksCleared(),
    ]
    batch = msgspec.msgpack.Decoder(LegacyBatch).decode(encode(events))
    assert batch.events == [
        LegacyStored(engine_hashes, None, [], 16, None, "CPU"),
        LegacyRemoved([1], "CPU"),
        LegacyCleared(),
    ]


def test_map_form_is_not_the_array_form() -> None:
    """The failure the switch exists for: an array-only reader rejects maps."""
    payload = encode(wire(OffloadingEvent(as_keys([1]), 16), True))
    with pytest.raises(msgspec.ValidationError, match=r"Expected `array`, got `object`"):
        msgspec.msgpack.Decoder(LegacyBatch).decode(payload)


def test_int_block_hashes_are_the_ints_the_engine_sent() -> None:
    engine_hashes = [1, 2**64 - 5, 123456789]
    keys = as_keys(engine_hashes)
    (event,) = wire(OffloadingEvent([*keys, K[2]], 16), as_int=True)
    assert isinstance(event, msgspec.Struct)
    assert msgspec.structs.asdict(event)["block_hashes"] == [*engine_hashes, K[2]]


def test_bytes_hashes_by_default() -> None:
    (event,) = wire(OffloadingEvent(as_keys([7]), 16))
    assert msgspec.structs.asdict(event)["block_hashes"] == [(7).to_bytes(8, "big")]


def test_medium_comes_from_the_index_event() -> None:
    events = wire(OffloadingEvent(K[:1], 16, medium="DISK", removed=True))
    assert msgspec.msgpack.decode(encode(events))[1][0]["medium"] == "DISK"


def test_unknown_format_is_refused() -> None:
    with pytest.raises(KeyError):
        to_wire(OffloadingEvent(K[:1], 16), False, "json")  # type: ignore[arg-type]


def test_topic_format() -> None:
    assert format_topic("kv@{hostname}@{pool}", "node-3", "llama") == b"kv@node-3@llama"
    assert format_topic("kvd.{pool}", "h", "p") == b"kvd.p"


START = (41).to_bytes(8, "big")


@pytest.mark.parametrize(
    ("frames", "envelope", "start"),
    [
        ([b"", START], [b""], 41),  # vLLM's client (DEALER or REQ): the delimiter is echoed
        ([START], [], 41),  # bare DEALER
        ([b"\x00\x01\x02\x03", b"", START], [b"\x00\x01\x02\x03", b""], 41),  # REQ_CORRELATE
        ([b"", (2**64 - 1).to_bytes(8, "big")], [b""], 2**64 - 1),
        ([b"", b"short"], [b""], None),
        ([b"", START, START], [b""], None),
        ([b"", b""], [b""], None),
        ([b""], [b""], None),
        ([], [], None),
        ([b"x" * 9], [], None),
    ],
)
def test_parse_replay_request(
    frames: list[bytes], envelope: list[bytes], start: int | None
) -> None:
    assert parse_replay_request(frames) == (envelope, start)


def test_end_marker_is_minus_one() -> None:
    assert int.from_bytes(END_SEQ, "big", signed=True) == -1
    assert END_SEQ == b"\xff" * 8
