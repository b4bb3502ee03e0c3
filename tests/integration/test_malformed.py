"""Runs in the test process: hostile frames get an `Error` each and the daemon keeps serving."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import msgspec
import zmq

from kvd_client import protocol as p
from kvd_client.errors import ErrorCode
from kvd_tools.launcher import DaemonProcess

LAYOUT = p.Layout("m", "bfloat16", 16, 1, False, 4096)


def _bad_frames(rng: random.Random, n: int) -> list[bytes]:
    enc = p.encoder.encode
    valid = [
        enc(p.Lookup(1, [b"abc", b"def"])),
        enc(p.Store(2, [b"k1"], [3])),
        enc(p.Attach(3, "pool", LAYOUT, 1 << 20)),
        enc(p.CompleteStore(4, [b"k"], True)),
    ]
    makers = [
        lambda: rng.randbytes(rng.randint(0, 64)),  # random bytes
        lambda: (v := rng.choice(valid))[: rng.randint(0, len(v) - 1)],  # truncated
        lambda: msgspec.msgpack.encode(["NoSuchTag", 5, [b"k"]]),  # unknown tag
        lambda: msgspec.msgpack.encode(["Lookup", 6, "not-a-list"]),  # wrong type
        lambda: msgspec.msgpack.encode({"type": "Lookup", "req_id": 7}),  # map, not array
        lambda: msgspec.msgpack.encode(["Lookup", "seven", []]),  # wrong req_id type
        lambda: msgspec.msgpack.encode(rng.random()),
        lambda: enc(p.Lookup(8, [b""])),  # empty key
        lambda: enc(p.Lookup(9, [b"x" * 65])),  # key too long
        lambda: enc(p.Lookup(10, [b"k"] * (p.MAX_KEYS_PER_REQUEST + 1))),  # too many keys
        lambda: enc(p.Store(11, [b"k1", b"k2"], [1])),  # length mismatch
        lambda: enc(p.Store(12, [b"k1"], [-1])),  # negative device id
        lambda: enc(p.Load(13, [b"k1"], [1 << 50])),  # huge device id
        lambda: enc(p.CompleteLoad(14, [b"never-pinned"])),
        lambda: enc(p.PrepareLoad(15, [b"absent"])),
        lambda: enc(p.JobDone(16, 1, 0, True)),  # a scheduler may not ack jobs
        lambda: enc(p.Attach(17, "other-pool", LAYOUT, 1 << 20)),  # one pool per session
        lambda: enc(p.Attach(18, "bad name!", LAYOUT, 1 << 20)),
        lambda: enc(p.Reset(19, "no-such-pool")),
        lambda: enc(p.DropPool(19, "pool")),  # without the operator token
        lambda: enc(p.Hello(20, -5, "scheduler")),
    ]
    return [rng.choice(makers)() for _ in range(n)]


def _attached_scheduler(daemon: DaemonProcess) -> tuple[zmq.Socket, Callable[[bytes], p.Reply]]:
    """A raw DEALER that said Hello as a scheduler and attached pool "pool", and
    `ask(frame)`: one frame sent, its reply decoded."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)

    def ask(frame: bytes) -> p.Reply:
        sock.send(frame)
        assert sock.poll(5000), "the daemon stopped answering"
        return p.reply_decoder.decode(sock.recv())

    hello = ask(p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, "scheduler")))
    assert isinstance(hello, p.Welcome)
    assert isinstance(ask(p.encoder.encode(p.Attach(2, "pool", LAYOUT, 1 << 20))), p.Attached)
    return sock, ask


def test_ten_thousand_malformed_frames(daemon: DaemonProcess) -> None:
    # Built before the session opens: building them takes longer than the test
    # daemon's 600 ms lease, during which the session would be silent.
    frames = _bad_frames(random.Random(1234), 10_000)
    sock, ask = _attached_scheduler(daemon)
    try:
        codes: dict[str, int] = {}
        for start in range(0, len(frames), 500):  # pipelined in windows of 500
            batch = frames[start : start + 500]
            for frame in batch:
                sock.send(frame)
            for _ in batch:
                assert sock.poll(10_000), "the daemon stopped answering"
                reply = p.reply_decoder.decode(sock.recv())
                assert isinstance(reply, p.Error), reply
                codes[reply.code] = codes.get(reply.code, 0) + 1
        assert sum(codes.values()) == 10_000
        assert set(codes) <= {c.value for c in ErrorCode}
        assert {"BAD_REQUEST", "WRONG_ROLE", "NOT_OWNER", "MISSING", "NO_SUCH_POOL"} <= set(codes)

        # A multi-frame message is refused too, not dropped.
        sock.send_multipart([b"a", b"b"])
        assert sock.poll(5000)
        assert isinstance(p.reply_decoder.decode(sock.recv()), p.Error)

        # An oversized frame is dropped by the transport; the daemon keeps serving.
        big = zmq.Context.instance().socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(daemon.endpoint)
        big.send(b"\x00" * (p.MAX_FRAME_BYTES + 1))
        assert not big.poll(300)
        big.close()

        reply = ask(p.encoder.encode(p.Lookup(99, [b"abc"])))
        assert isinstance(reply, p.LookupResult) and reply.req_id == 99 and reply.hits == 0
        inv = ask(p.encoder.encode(p.CheckInvariants(100, daemon.admin_token)))
        assert isinstance(inv, p.InvariantsResult) and inv.problems == []
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        sock.close()


def test_undecodable_frames_renew_the_lease(daemon: DaemonProcess) -> None:
    """SPEC 7: any message renews a lease, one the daemon cannot decode too."""
    sock, ask = _attached_scheduler(daemon)
    try:
        deadline = time.monotonic() + 3 * 0.6  # three of the test daemon's leases
        while time.monotonic() < deadline:
            assert ask(b"\xc1garbage").code == "BAD_REQUEST"  # 0xc1: never valid msgpack
            time.sleep(0.1)
        assert isinstance(ask(p.encoder.encode(p.Lookup(3, [b"k"]))), p.LookupResult)
    finally:
        sock.close()
