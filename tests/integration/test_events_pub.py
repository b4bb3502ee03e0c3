"""Runs in the test process: the event publisher over real ipc:// sockets (no daemon).

The subscriber side uses only the wire format (SPEC section 8): its own msgspec
types for vLLM 0.32's tagged maps and for the older arrays, raw ZeroMQ SUB,
DEALER and REQ sockets.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvd.io.events import EventPublisher
from kvd_client.types import OffloadingEvent

END = b"\xff" * 8
WAIT_MS = 10_000  # generous: CI machines are small and busy


class KVCacheEvent(msgspec.Struct, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ArrayStored(msgspec.Struct, array_like=True, gc=False, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayCleared(msgspec.Struct, array_like=True, gc=False, tag="AllBlocksCleared"):
    pass


class ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayStored | ArrayCleared]


decode = msgspec.msgpack.Decoder(Batch).decode


def local_stored(ks: list[bytes], block_tokens: int = 16) -> BlockStored:
    """What the daemon says about 8-byte keys it stored (bytes hashes by default)."""
    return BlockStored(ks, None, [], block_tokens, None, "CPU")


def keys(n: int, start: int = 0) -> list[bytes]:
    return [(start + i).to_bytes(8, "big") for i in range(n)]


def stored(ks: list[bytes], block_tokens: int = 16) -> OffloadingEvent:
    return OffloadingEvent(ks, block_tokens)


def removed(ks: list[bytes]) -> OffloadingEvent:
    return OffloadingEvent(ks, 16, removed=True)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def rundir() -> Iterator[Path]:
    # Short: a Unix socket path must fit in 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="kvd-e"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pub(ctx: zmq.Context[zmq.Socket[bytes]], rundir: Path) -> Iterator[EventPublisher]:
    with EventPublisher(
        ctx, f"ipc://{rundir}/events.sock", f"ipc://{rundir}/replay.sock", hostname="h1"
    ) as p:
        yield p


def sock(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, endpoint: str) -> zmq.Socket[bytes]:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    s.connect(endpoint)
    return s


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher) -> zmq.Socket[bytes]:
    """A SUB that is known to be joined: a PUB drops everything sent before that."""
    sub = sock(ctx, zmq.SUB, pub.pub_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for _ in range(100):
        pub.all_cleared("warmup")
        pub.flush(0.0)
        if sub.poll(20):
            break
    else:
        pytest.fail("the subscriber never joined")
    while sub.poll(50):
        sub.recv_multipart()
    return sub


def receive(sub: zmq.Socket[bytes]) -> tuple[bytes, int, Batch]:
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), decode(payload)


def serve(pub: EventPublisher, s: zmq.Socket[bytes]) -> None:
    """Runs the daemon's side until the client has something to read."""
    for _ in range(WAIT_MS // 10):
        pub.handle_replay()
        if s.poll(10):
            return


def recv_served(pub: EventPublisher, s: zmq.Socket[bytes]) -> list[bytes]:
    """Runs the daemon's side until `s` receives a message, and returns it.

    Unlike `serve`, it does not trust `poll`: a REQ with REQ_CORRELATE polls
    readable for a stale reply that its `recv` then discards.
    """
    for _ in range(WAIT_MS // 10):
        pub.handle_replay()
        try:
            return s.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            s.poll(10)
    raise AssertionError(f"no reply within {WAIT_MS} ms")


def replay(s: zmq.Socket[bytes], pub: EventPublisher, request: list[bytes]) -> list[list[bytes]]:
    """Sends one request, serves it, and returns the reply messages up to the end marker."""
    s.send_multipart(request)
    serve(pub, s)
    out = []
    while True:
        msg = s.recv_multipart()
        out.append(msg)
        if msg[-1] == b"" and msg[-2] == END:
            return out


def test_batch_decodes_with_topic_seq_and_ts(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher
) -> None:
    sub = subscriber(ctx, pub)
    first = pub.next_seq
    pub.add("llama", [stored(keys(3), 32), removed(keys(1))])
    pub.all_cleared("llama")
    assert pub.flush(1234.5) == 1
    topic, seq, batch = receive(sub)
    assert topic == b"kv@h1@llama"
    assert seq == first
    assert batch.ts == 1234.5
    assert batch.events == [
        local_stored(keys(3), 32),
        BlockRemoved(keys(1), "CPU"),
        AllBlocksCleared(),
    ]
    sub.close()


def test_one_message_per_pool_per_flush_and_seq_monotonic(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher
) -> None:
    sub = subscriber(ctx, pub)
    first, batches0, events0 = pub.next_seq, pub.batches_sent, pub.events_sent
    for i in range(100):
        pub.add("a" if i % 2 else "b", [stored(keys(1, i))])
    pub.add("a", [stored([])])  # nothing to say: no event
    assert pub.pending
    assert pub.flush(1.0) == 2
    assert not pub.pending
    assert pub.flush(2.0) == 0  # nothing pending, nothing sent, no seq used
    for t in range(3):
        pub.add("c", [removed(keys(1, t))])
        pub.flush(3.0 + t)
    got = [receive(sub) for _ in range(5)]
    assert not sub.poll(100)
    assert [seq for _, seq, _ in got] == list(range(first, first + 5))
    by_topic = {topic: batch for topic, _, batch in got[:2]}
    assert set(by_topic) == {b"kv@h1@a", b"kv@h1@b"}
    a_hashes = [e.block_hashes[0] for e in by_topic[b"kv@h1@a"].events]
    assert a_hashes == keys(1, 1) + [k for i in range(3, 100, 2) for k in keys(1, i)]
    assert len(by_topic[b"kv@h1@b"].events) == 50
    assert pub.batches_sent - batches0 == 5
    assert pub.events_sent - events0 == 103
    assert pub.next_seq == first + 5
    sub.close()


def hashes(batch: Batch) -> list[bytes | int]:
    event = batch.events[0]
    assert isinstance(event, BlockStored | BlockRemoved)
    return event.block_hashes


def publish_batches(pub: EventPublisher, n: int) -> list[int]:
    seqs = []
    for i in range(n):
        seqs.append(pub.next_seq)
        pub.add("p", [stored(keys(1, i))])
        pub.flush(float(i))
    return seqs


def test_replay_to_dealer_with_and_without_delimiter(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher
) -> None:
    seqs = publish_batches(pub, 5)
    dealer = sock(ctx, zmq.DEALER, pub.replay_endpoint)
    # vLLM 0.32's framing: [b"", start] in; [b"", topic, seq, payload] per batch,
    # then [b"", b"", END_SEQ, b""].
    msgs = replay(dealer, pub, [b"", seqs[2].to_bytes(8, "big")])
    assert [len(m) for m in msgs] == [4, 4, 4, 4]
    assert [m[:2] for m in msgs[:-1]] == [[b"", b"kv@h1@p"]] * 3
    assert [int.from_bytes(m[2], "big") for m in msgs[:-1]] == seqs[2:]
    assert [hashes(decode(m[3])) for m in msgs[:-1]] == [keys(1, 2), keys(1, 3), keys(1, 4)]
    assert msgs[-1] == [b"", b"", END, b""]
    # A bare DEALER (no delimiter) gets the same frames without it.
    msgs = replay(dealer, pub, [seqs[4].to_bytes(8, "big")])
    assert msgs[0][:2] == [b"kv@h1@p", seqs[4].to_bytes(8, "big")]
    assert msgs[1] == [b"", END, b""]
    # Past the newest batch: just the end marker.
    assert replay(dealer, pub, [b"", (seqs[4] + 1).to_bytes(8, "big")]) == [[b"", b"", END, b""]]
    dealer.close()


def test_replay_answers_each_batch_under_its_own_topic(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher
) -> None:
    first = pub.next_seq
    pub.add("a", [stored(keys(1, 1))])
    pub.add("b", [stored(keys(1, 2))])
    pub.flush(1.0)
    pub.all_cleared("a")
    pub.flush(2.0)
    dealer = sock(ctx, zmq.DEALER, pub.replay_endpoint)
    msgs = replay(dealer, pub, [b"", first.to_bytes(8, "big")])
    got = [(m[1], int.from_bytes(m[2], "big"), decode(m[3]).events) for m in msgs[:-1]]
    assert got == [
        (b"kv@h1@a", first, [local_stored(keys(1, 1))]),
        (b"kv@h1@b", first + 1, [local_stored(keys(1, 2))]),
        (b"kv@h1@a", first + 2, [AllBlocksCleared()]),
    ]
    dealer.close()


def test_replay_to_req_clients(ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher) -> None:
    seqs = publish_batches(pub, 3)
    # vLLM's example subscriber: a plain REQ takes the first reply of a request.
    req = sock(ctx, zmq.REQ, pub.replay_endpoint)
    req.send(seqs[1].to_bytes(8, "big"))
    serve(pub, req)
    topic, seq, payload = req.recv_multipart()
    assert topic == b"kv@h1@p"
    assert int.from_bytes(seq, "big") == seqs[1]
    assert decode(payload).events[0] == local_stored(keys(1, 1))
    req.close()
    req = sock(ctx, zmq.REQ, pub.replay_endpoint)
    req.send((seqs[-1] + 10).to_bytes(8, "big"))
    serve(pub, req)
    assert req.recv_multipart() == [b"", END, b""]
    req.close()
    # A REQ with REQ_CORRELATE pages through one batch per request: the daemon
    # echoes its request id, so the stale rest of each answer is discarded.
    req = sock(ctx, zmq.REQ, pub.replay_endpoint)
    req.setsockopt(zmq.REQ_RELAXED, 1)
    req.setsockopt(zmq.REQ_CORRELATE, 1)
    got = []
    start = seqs[0]
    while True:
        req.send(start.to_bytes(8, "big"))
        _, seq, payload = recv_served(pub, req)
        if payload == b"":
            break
        got.append(int.from_bytes(seq, "big"))
        start = got[-1] + 1
    assert got == seqs
    req.close()


def test_malformed_replay_requests_get_the_end_marker(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher
) -> None:
    seqs = publish_batches(pub, 2)
    dealer = sock(ctx, zmq.DEALER, pub.replay_endpoint)
    assert replay(dealer, pub, [b"abc"]) == [[b"", END, b""]]
    assert replay(dealer, pub, [b"", b"x" * 9]) == [[b"", b"", END, b""]]
    assert replay(dealer, pub, [b"\x00" * 8, b"\x00" * 8]) == [[b"", END, b""]]
    assert replay(dealer, pub, [b""]) == [[b"", b"", END, b""]]
    # The socket still serves well-formed requests afterwards.
    msgs = replay(dealer, pub, [seqs[0].to_bytes(8, "big")])
    assert len(msgs) == 3
    assert pub.handle_replay() is False
    dealer.close()


def test_oversized_replay_request_is_dropped_and_serving_goes_on(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher
) -> None:
    publish_batches(pub, 1)
    big = sock(ctx, zmq.DEALER, pub.replay_endpoint)
    big.send(b"\x00" * (1 << 20))  # over MAXMSGSIZE: the daemon drops the peer
    for _ in range(20):
        pub.handle_replay()
        big.poll(10)
    assert pub.replays_served == 0
    big.close()
    dealer = sock(ctx, zmq.DEALER, pub.replay_endpoint)
    assert len(replay(dealer, pub, [b"\x00" * 8])) == 2
    dealer.close()


def test_ring_buffer_keeps_the_newest_batches(
    ctx: zmq.Context[zmq.Socket[bytes]], rundir: Path
) -> None:
    with EventPublisher(ctx, "", f"ipc://{rundir}/replay.sock", buffer_size=3, hostname="h") as pub:
        seqs = publish_batches(pub, 7)
        dealer = sock(ctx, zmq.DEALER, pub.replay_endpoint)
        msgs = replay(dealer, pub, [b"", b"\x00" * 8])
        assert [int.from_bytes(m[2], "big") for m in msgs[:-1]] == seqs[-3:]
        msgs = replay(dealer, pub, [b"", seqs[5].to_bytes(8, "big")])
        assert [int.from_bytes(m[2], "big") for m in msgs[:-1]] == seqs[5:]
        dealer.close()


def test_replay_served_from_an_asyncio_reader(
    ctx: zmq.Context[zmq.Socket[bytes]], pub: EventPublisher
) -> None:
    """The way the daemon drives it: the edge-triggered FD under `add_reader`."""
    seqs = publish_batches(pub, 2)
    dealer = sock(ctx, zmq.DEALER, pub.replay_endpoint)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        fd = pub.replay_fd
        assert fd is not None
        loop.add_reader(fd, pub.handle_replay)
        try:
            pub.handle_replay()  # an edge may have passed before the reader was added
            await asyncio.sleep(0.05)
            dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
            for _ in range(WAIT_MS // 10):
                if pub.replays_served:
                    return
                await asyncio.sleep(0.01)
        finally:
            loop.remove_reader(fd)

    asyncio.run(serve())
    assert pub.replays_served == 1
    assert len([dealer.recv_multipart() for _ in range(3)]) == 3
    dealer.close()


def test_array_form_behind_the_switch(ctx: zmq.Context[zmq.Socket[bytes]], rundir: Path) -> None:
    with EventPublisher(
        ctx,
        f"ipc://{rundir}/ev.sock",
        f"ipc://{rundir}/rp.sock",
        hostname="h",
        int_block_hashes=True,
        event_format="array",
    ) as pub:
        sub = subscriber(ctx, pub)
        first = pub.next_seq
        pub.add("p", [stored(keys(2, 5))])
        pub.all_cleared("p")
        pub.flush(3.0)
        topic, seq, payload = sub.recv_multipart()
        assert (topic, int.from_bytes(seq, "big")) == (b"kv@h@p", first)
        assert msgspec.msgpack.decode(payload)[1] == [
            ["BlockStored", [5, 6], None, [], 16, None, "CPU", None, None, None, None, None],
            ["AllBlocksCleared"],
        ]
        assert msgspec.msgpack.Decoder(ArrayBatch).decode(payload).events == [
            ArrayStored([5, 6], None, [], 16, None, "CPU"),
            ArrayCleared(),
        ]
        # The replay framing does not depend on the form.
        dealer = sock(ctx, zmq.DEALER, pub.replay_endpoint)
        msgs = replay(dealer, pub, [b"", first.to_bytes(8, "big")])
        assert msgs == [[b"", b"kv@h@p", seq, payload], [b"", b"", END, b""]]
        dealer.close()
        sub.close()
    with pytest.raises(ValueError, match="event_format"):
        EventPublisher(ctx, "", "", event_format="xml")  # type: ignore[arg-type]


def test_ring_bytes_count_topics_and_payloads(
    ctx: zmq.Context[zmq.Socket[bytes]], rundir: Path
) -> None:
    with EventPublisher(ctx, "", f"ipc://{rundir}/replay.sock", hostname="h") as pub:
        pub.all_cleared("p")
        pub.flush(1.0)
        one = pub.ring_bytes
        assert one > len(b"kv@h@p")
        # A byte bound below two batches keeps only the newest one.
        pub.buffer_bytes = one + 1
        pub.all_cleared("p")
        pub.flush(2.0)
        assert (pub.ring_bytes, pub.batches_dropped) == (one, 1)


def test_socket_files_are_0660_and_removed_on_close(
    ctx: zmq.Context[zmq.Socket[bytes]], rundir: Path
) -> None:
    ev, rp = rundir / "ev.sock", rundir / "rp.sock"
    rp.write_bytes(b"")  # a stale file from a killed daemon is replaced
    pub = EventPublisher(ctx, f"ipc://{ev}", f"ipc://{rp}", gid=os.getgid())
    for path in (ev, rp):
        st = path.stat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
    pub.close()
    pub.close()  # idempotent
    assert not ev.exists() and not rp.exists()


def test_failed_bind_closes_what_was_opened(
    ctx: zmq.Context[zmq.Socket[bytes]], rundir: Path
) -> None:
    ev = rundir / "ev.sock"
    with pytest.raises(zmq.ZMQError):
        EventPublisher(ctx, f"ipc://{ev}", f"ipc://{rundir}/missing-dir/rp.sock")
    assert not ev.exists()


def test_tcp_endpoints_resolve_their_ports(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with EventPublisher(ctx, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", hostname="h") as pub:
        for endpoint in (pub.pub_endpoint, pub.replay_endpoint):
            assert endpoint.startswith("tcp://127.0.0.1:")
            assert int(endpoint.rsplit(":", 1)[1]) > 0
        sub = subscriber(ctx, pub)
        pub.add("p", [stored(keys(2))])
        pub.flush(5.0)
        assert hashes(receive(sub)[2]) == keys(2)
        sub.close()


def test_disabled_publisher_does_nothing(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with EventPublisher(ctx, "", "") as pub:
        pub.add("p", [stored(keys(1))])
        pub.all_cleared("p")
        assert not pub.pending
        assert pub.flush(1.0) == 0
        assert pub.replay_fd is None
        assert pub.handle_replay() is False
        assert (pub.pub_endpoint, pub.replay_endpoint) == ("", "")


def test_custom_topic_and_bad_arguments(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with EventPublisher(ctx, "", "", hostname="n1", topic_format="kvd/{pool}/{hostname}") as pub:
        assert pub.topic("x") == b"kvd/x/n1"
    with pytest.raises(ValueError, match="topic format"):
        EventPublisher(ctx, "", "", topic_format="kv@{host}")
    with pytest.raises(ValueError, match="buffer_size"):
        EventPublisher(ctx, "", "", buffer_size=-1)
