"""Runs in the test process: the KV-event encoding, read back as a vLLM consumer would.

The consumer types below are written from the wire format alone (they copy
vLLM's `kv_events_subscriber` example), never imported from `kvd.io.events`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvd.io.events import (
    END_SEQ,
    AllBlocksCleared,
    KVEventBatch,
    format_topic,
    parse_replay_request,
    to_wire,
)
from kvd_client.scheduler import as_keys
from kvd_client.types import OffloadingEvent

# -- consumer types: vLLM 0.12+ (bytes | int hashes, lora_name) -----------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class Batch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllCleared]


# -- consumer types: the older example (int hashes, no lora_name) ---------------


class LegacyStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class LegacyRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class LegacyBatch(EventBatch):
    events: list[LegacyStored | LegacyRemoved | AllCleared]


K = [b"\x00" * 7 + b"\x01", b"\xff" * 8, b"a-longer-key-of-20-b"]


def encode(events: list[Any], ts: float = 1.5) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts, events))


def test_wire_shape_is_vllm_positional_arrays() -> None:
    payload = encode(
        [
            to_wire(OffloadingEvent(K[:2], 16)),
            to_wire(OffloadingEvent(K[2:], 16, removed=True)),
            AllBlocksCleared(),
        ]
    )
    assert msgspec.msgpack.decode(payload) == [
        1.5,
        [
            ["BlockStored", K[:2], None, [], 16, None, "CPU", None],
            ["BlockRemoved", K[2:], "CPU"],
            ["AllBlocksCleared"],
        ],
        None,
    ]


def test_consumer_types_decode_stored_removed_cleared() -> None:
    payload = encode(
        [
            to_wire(OffloadingEvent(K, 32)),
            to_wire(OffloadingEvent([K[0]], 32, removed=True)),
            AllBlocksCleared(),
        ],
        ts=99.25,
    )
    batch = msgspec.msgpack.Decoder(Batch).decode(payload)
    assert batch.ts == 99.25
    stored, removed, cleared = batch.events
    assert stored == BlockStored(K, None, [], 32, None, "CPU", None)
    assert removed == BlockRemoved([K[0]], "CPU")
    assert isinstance(cleared, AllCleared)


def test_int_block_hashes_are_the_ints_the_engine_sent() -> None:
    engine_hashes = [1, 2**64 - 5, 123456789]
    keys = as_keys(engine_hashes)
    event = to_wire(OffloadingEvent([*keys, K[2]], 16), int_block_hashes=True)
    assert event.block_hashes == [*engine_hashes, K[2]]  # only 8-byte keys become ints
    # The older example's types (list[int]) read them as they read vLLM's own events.
    only_ints = encode([to_wire(OffloadingEvent(keys, 16), True), AllBlocksCleared()])
    batch = msgspec.msgpack.Decoder(LegacyBatch).decode(only_ints)
    assert batch.events[0] == LegacyStored(engine_hashes, None, [], 16, None, "CPU")
    removed = encode([to_wire(OffloadingEvent(keys[:1], 16, removed=True), True)])
    assert msgspec.msgpack.Decoder(LegacyBatch).decode(removed).events == [
        LegacyRemoved([1], "CPU")
    ]


def test_bytes_hashes_by_default() -> None:
    event = to_wire(OffloadingEvent(as_keys([7]), 16))
    assert event.block_hashes == [(7).to_bytes(8, "big")]


def test_medium_comes_from_the_index_event() -> None:
    event = to_wire(OffloadingEvent(K[:1], 16, medium="DISK", removed=True))
    assert msgspec.msgpack.decode(encode([event]))[1] == [["BlockRemoved", K[:1], "DISK"]]


def test_topic_format() -> None:
    assert format_topic("kv@{hostname}@{pool}", "node-3", "llama") == b"kv@node-3@llama"
    assert format_topic("kvd.{pool}", "h", "p") == b"kvd.p"


START = (41).to_bytes(8, "big")


@pytest.mark.parametrize(
    ("frames", "envelope", "start"),
    [
        ([b"", START], [b""], 41),  # REQ client: the delimiter is echoed
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
