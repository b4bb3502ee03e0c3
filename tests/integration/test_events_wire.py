"""Runs in the test process: a real daemon's KV events and metrics, read as their consumers would.

The subscriber uses only the wire format (SPEC section 8): its own msgspec
types for vLLM 0.32's tagged-map events, raw SUB, DEALER and REQ sockets, and
plain HTTP for /metrics. vLLM's own decoder reads the same daemon in
test_events_vllm.py.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import pytest
import zmq

from kvd_client import Layout, Scheduler
from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_tools.launcher import DaemonProcess

END = b"\xff" * 8
LAYOUT = Layout("wire-model@1", "bfloat16", 16, 1, False, 4096)  # one 4 KiB row per block
DECLARED_TOML = """
[[pools]]
name = "declared"
model = "wire-model@1"
dtype = "bfloat16"
block_tokens = 16
world_size = 1
slot_bytes = 4096
capacity_bytes = 32768
"""


class KVCacheEvent(msgspec.Struct, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # No locality nor ownership: kvd sends neither (vLLM's CPU tier does not),
    # and a field not named here fails the decode.


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]


decode = msgspec.msgpack.Decoder(Batch).decode


@dataclass
class Message:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def events(self) -> list[Event]:
        return decode(self.payload).events


def ints(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def keys(n: int, start: int = 0) -> list[bytes]:
    return [(start + i).to_bytes(8, "big") for i in range(n)]


def topic(pool: str) -> bytes:
    return f"kv@{socket.gethostname()}@{pool}".encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Wired:
    daemon: DaemonProcess
    events: str
    replay: str
    ctx: zmq.Context[zmq.Socket[bytes]]


def start(metrics_addr: str) -> Wired:
    d = DaemonProcess(metrics_addr=metrics_addr, policy="lru")  # exact victims below
    (d.runtime_dir / "kvd.toml").write_text(DECLARED_TOML)
    events, replay = f"ipc://{d.runtime_dir}/events.sock", f"ipc://{d.runtime_dir}/replay.sock"
    d.flags.update(
        {
            "config": str(d.runtime_dir / "kvd.toml"),
            "events-endpoint": events,
            "replay-endpoint": replay,
        }
    )
    try:
        d.start()
    except BaseException:
        d.stop()
        raise
    return Wired(d, events, replay, zmq.Context())


@pytest.fixture
def wired() -> Iterator[Wired]:
    w = start("127.0.0.1:0")
    try:
        yield w
    finally:
        w.ctx.destroy(linger=0)
        w.daemon.stop()


def connect(w: Wired, kind: int, endpoint: str) -> zmq.Socket[bytes]:
    s = w.ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    return s


def admin(w: Wired, cls: type, *args: object) -> None:
    conn = Connection(w.daemon.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        assert isinstance(conn.call(cls, *args), p.Ok)
    finally:
        conn.close()


def collect(
    sub: zmq.Socket[bytes],
    seen: list[Message],
    done: Callable[[list[Message]], bool],
    timeout: float = 5.0,
) -> None:
    """Appends what the SUB receives to `seen` until `done(seen)` holds."""
    deadline = time.monotonic() + timeout
    while not done(seen):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out; received {[(m.topic, m.seq, m.events) for m in seen]}")
        if sub.poll(50):
            t, seq, payload = sub.recv_multipart()
            seen.append(Message(t, int.from_bytes(seq, "big"), payload))


def events_of(seen: list[Message], pool: str) -> list[Event]:
    return [e for m in seen if m.topic == topic(pool) for e in m.events]


def joined_subscriber(w: Wired, seen: list[Message]) -> zmq.Socket[bytes]:
    """A SUB known to be joined: stores blocks in a scratch pool until one event arrives."""
    sub = connect(w, zmq.SUB, w.events)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    with Scheduler("warm", LAYOUT, engine_id="warm", endpoint=w.daemon.endpoint) as s:
        for i in range(100):
            s.prepare_store(keys(1, 1000 + i))
            s.complete_store(keys(1, 1000 + i))
            if sub.poll(100):
                break
        else:
            pytest.fail("no event reached the subscriber")
    return sub


def stored(hashes: list[bytes | int], group_idx: int | None = None) -> BlockStored:
    return BlockStored(hashes, None, [], 16, None, "CPU", None, group_idx)


def removed(hashes: list[bytes | int], group_idx: int | None = None) -> BlockRemoved:
    return BlockRemoved(hashes, "CPU", group_idx)


def replay_all(w: Wired, start_seq: int) -> list[tuple[int, bytes]]:
    """vLLM 0.32's replay framing: [b"", start] in, [b"", topic, seq, payload]
    per batch, then [b"", b"", END_SEQ, b""]."""
    dealer = connect(w, zmq.DEALER, w.replay)
    dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
    out = []
    while True:
        empty, t, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END:
            assert (t, payload) == (b"", b"")
            dealer.close()
            return out
        assert t.startswith(b"kv@")
        out.append((int.from_bytes(seq, "big"), payload))


def test_store_evict_reset_drop_are_published_and_replayed(wired: Wired) -> None:
    w = wired
    seen: list[Message] = []
    sub = joined_subscriber(w, seen)
    # 8-byte keys are published as the ints the engine hashed (events_int_hashes).
    first = stored(ints(8))
    with Scheduler(
        "p", LAYOUT, engine_id="e", endpoint=w.daemon.endpoint, capacity_bytes=8 * 4096
    ) as s:
        assert s.attached is not None and s.attached.num_blocks == 8
        s.prepare_store(keys(8))
        s.complete_store(keys(8))
        collect(sub, seen, lambda m: first in events_of(m, "p"))
        out = s.prepare_store(keys(3, 100))  # full: evicts the three least recent
        assert out is not None and out.evicted_keys == keys(3)
        s.complete_store(keys(3, 100))
        collect(sub, seen, lambda m: len(events_of(m, "p")) >= 3)
        admin(w, p.Reset, "p", w.daemon.admin_token)
        collect(sub, seen, lambda m: events_of(m, "p").count(AllBlocksCleared()) == 2)
    admin(w, p.DropPool, "p", w.daemon.admin_token)
    collect(sub, seen, lambda m: events_of(m, "p").count(AllBlocksCleared()) == 3)

    assert events_of(seen, "p") == [
        AllBlocksCleared(),  # a new pool's topic starts clean
        first,
        removed(ints(3)),
        stored(ints(3, 100)),
        AllBlocksCleared(),  # reset
        AllBlocksCleared(),  # drop
    ]
    seqs = [m.seq for m in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(decode(m.payload).ts > 1e9 for m in seen)  # wall-clock seconds

    # Replay from 0: every batch, byte for byte what the SUB got, gap-free;
    # the first is the declared pool's AllBlocksCleared at startup.
    replayed = replay_all(w, 0)
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    assert decode(replayed[0][1]).events == [AllBlocksCleared()]
    by_seq = dict(replayed)
    for m in seen:
        assert by_seq[m.seq] == m.payload
    assert [seq for seq, _ in replay_all(w, seen[-1].seq)] == [seen[-1].seq]
    sub.close()


def test_vllm_offload_keys_carry_their_group(wired: Wired) -> None:
    """36-byte keys (vLLM's block hash + 4-byte group) are published with group_idx,
    their hash as vLLM publishes it."""
    w = wired
    seen: list[Message] = []
    sub = joined_subscriber(w, seen)
    ks = [bytes([i]) * 32 + g.to_bytes(4, "big") for i, g in ((1, 0), (2, 0), (3, 1))]
    with Scheduler("g", LAYOUT, engine_id="e", endpoint=w.daemon.endpoint) as s:
        s.prepare_store(ks)
        s.complete_store(ks)
        collect(sub, seen, lambda m: len(events_of(m, "g")) >= 3)
    # As vLLM publishes them: the block hash without the group bytes, as the
    # unsigned int of its low 64 bits (the daemon's default `events_int_hashes`).
    h = [int.from_bytes(k[24:32], "big") for k in ks]
    assert events_of(seen, "g") == [
        AllBlocksCleared(),
        stored([h[0], h[1]], group_idx=0),
        stored([h[2]], group_idx=1),
    ]
    sub.close()


def replay_first(w: Wired) -> list[tuple[int, bytes]]:
    """Replays from 0 until the startup batch is there (the daemon may flush it
    a tick after it first answers)."""
    deadline = time.monotonic() + 5
    while not (replayed := replay_all(w, 0)):
        if time.monotonic() > deadline:
            pytest.fail("the replay buffer stayed empty")
        time.sleep(0.05)
    return replayed


def test_replay_answers_req_and_malformed_requests(wired: Wired) -> None:
    w = wired
    assert decode(replay_first(w)[0][1]).events == [AllBlocksCleared()]
    req = connect(w, zmq.REQ, w.replay)  # a REQ takes the first reply only
    req.send((0).to_bytes(8, "big"))
    t, seq, payload = req.recv_multipart()
    assert (t, int.from_bytes(seq, "big")) == (topic("declared"), 0)
    assert decode(payload).events == [AllBlocksCleared()]
    req.close()
    dealer = connect(w, zmq.DEALER, w.replay)
    dealer.send(b"not eight bytes")
    assert dealer.recv_multipart() == [b"", END, b""]
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    assert dealer.recv_multipart()[:3] == [b"", topic("declared"), (0).to_bytes(8, "big")]
    dealer.close()
    conn = Connection(w.daemon.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()  # the daemon is still serving
    conn.close()


def test_metrics_endpoint_of_a_running_daemon() -> None:
    port = free_port()
    w = start(f"127.0.0.1:{port}")
    try:
        with Scheduler(
            "m", LAYOUT, engine_id="e", endpoint=w.daemon.endpoint, capacity_bytes=4 * 4096
        ) as s:
            s.prepare_store(keys(4))
            s.complete_store(keys(4))
            s.prepare_store(keys(2, 50))  # evicts two
            assert s.lookup(keys(2, 2)) == 2
            wanted = [
                'kvd_pool_blocks{pool="declared",state="free"} 8.0',
                'kvd_pool_capacity_bytes{pool="m"} 16384.0',
                'kvd_pool_blocks{pool="m",state="in_flight"} 2.0',
                "kvd_evictions_total 2.0",
                "kvd_lookups_total 1.0",
                "kvd_hit_blocks_total 2.0",
                'kvd_rpc_duration_seconds_count{type="PrepareStore"} 2.0',
                "kvd_sessions 1.0",
            ]
            deadline = time.monotonic() + 5
            while True:
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    text = r.read().decode()
                missing = [line for line in wanted if line not in text]
                if not missing:
                    break
                if time.monotonic() > deadline:
                    pytest.fail(f"missing {missing} in:\n{text}")
                time.sleep(0.1)
    finally:
        w.ctx.destroy(linger=0)
        w.daemon.stop()
