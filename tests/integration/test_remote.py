"""Runs in the test process: the remote tier on real Redis, standalone and cluster (issue 17).

Two daemons in two runtime dirs stand for two hosts. Engines (a scheduler
and real worker processes) on daemon A store blocks; daemon A writes them
behind to the remote tier; an engine on daemon B, with an empty pool, looks
them up (None first, then hits), loads them, and gets the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvd.io.remote_value import (
    HEADER_BYTES,
    encode_value,
    layout_fingerprint,
    remote_key,
)
from kvd_client.geometry import Geometry
from kvd_tools.redis_launcher import RedisClusterProcesses, RedisServer
from tests.integration.remote_hosts import (
    BLOCKS,
    SLOT_BYTES,
    TP,
    Engine,
    Hosts,
    counters,
    fetch_all,
    hosts_on,
    needs_redis,
    wait_for,
)  # fmt: skip

pytestmark = needs_redis


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def hosts(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    store: Any = RedisServer() if request.param == "standalone" else RedisClusterProcesses(3)
    store.start()
    try:
        with hosts_on(store.url, 2) as (a, b):
            yield Hosts(request.param, store, a, b)
    finally:
        store.stop()


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
def test_a_block_stored_on_one_host_is_loaded_on_another(hosts: Hosts, replicated: bool) -> None:
    pool = f"share-{int(replicated)}"
    keys = [f"{pool}/{hosts.kind}/{i}".encode() for i in range(BLOCKS)]
    before_a = counters(hosts.a.daemon)
    a = Engine(hosts.a, pool, replicated)
    try:
        stored = a.store(keys, seed=11)
        wait_for("the write-behind", lambda: counters(hosts.a.daemon).get(
            "remote.blocks_written", 0) >= before_a.get("remote.blocks_written", 0) + BLOCKS)  # fmt: skip
    finally:
        a.close()
    b = Engine(hosts.b, pool, replicated)
    try:
        first = b.scheduler.lookup(keys)
        assert first is None  # the daemon asks the remote tier: retry later
        seen = fetch_all(b.scheduler, keys)
        assert set(seen) <= {None, BLOCKS}
        loaded = b.load(keys)
        for rank in range(TP):
            expected = stored[0] if replicated else stored[rank]  # every rank reads slot 0
            assert loaded[rank] == expected, f"rank {rank}: bytes differ"
        c = counters(hosts.b.daemon)
        assert c["remote.hits"] >= BLOCKS
        assert c.get("remote.bad_values", 0) == 0
        # Fetched blocks are not written back.
        assert c.get("remote.blocks_written", 0) == 0
        # ... and are announced as any stored block: BlockStored, medium CPU.
        stored_events = [e for e in replayed_events(hosts.b.daemon)
                         if e.get("type") == "BlockStored"]  # fmt: skip
        announced = [h for e in stored_events if e.get("medium") == "CPU"
                     for h in e["block_hashes"]]  # fmt: skip
        assert set(keys) <= set(announced)
    finally:
        b.close()


def test_pools_of_other_layouts_never_see_the_blocks(hosts: Hosts) -> None:
    pool = "foreign"
    keys = [f"{pool}/{hosts.kind}/{i}".encode() for i in range(4)]
    before = counters(hosts.a.daemon).get("remote.blocks_written", 0)
    a = Engine(hosts.a, pool, False, extra="layout-one")
    try:
        a.store(keys, seed=3)
        wait_for("the write-behind", lambda: counters(hosts.a.daemon).get(
            "remote.blocks_written", 0) >= before + 4)  # fmt: skip
    finally:
        a.close()
    b = Engine(hosts.b, pool + "-2", False, extra="layout-two")
    try:
        seen = [b.scheduler.lookup(keys) for _ in range(3)]
        wait_for("the miss", lambda: b.scheduler.lookup(keys) == 0)
        assert all(h in (None, 0) for h in seen)
    finally:
        b.close()


def replayed_events(d: Any) -> list[dict[str, Any]]:
    """Every event the daemon's replay socket holds, decoded as plain msgpack."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{d.runtime_dir}/replay.sock")
    events: list[dict[str, Any]] = []
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert sock.poll(5000), "no end marker from the replay socket"
            _, topic, _, payload = sock.recv_multipart()
            if not topic:
                return events
            batch = msgspec.msgpack.decode(payload)
            events += [e for e in batch[1] if isinstance(e, dict)]
    finally:
        sock.close()
        ctx.term()


def plain_client(store: Any) -> Any:
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    if isinstance(store, RedisServer):
        return redis.Redis(port=store.port)
    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in store.nodes])


def test_bad_values_are_misses_never_data(hosts: Hosts) -> None:
    """Values written with a plain client: corrupt, truncated, another block's,
    another layout's row, another format version. Each is a miss, counted."""
    pool = "bad"
    e = Engine(hosts.b, pool, False)
    try:
        g = Geometry.plan(slot_bytes=SLOT_BYTES, world_size=TP, replicated=False,
                          capacity_bytes=1 << 30)  # fmt: skip
        fp = layout_fingerprint(e.layout, g)
        row = bytes(range(256)) * (g.row_bytes // 256)
        client = plain_client(hosts.store)
        keys = [f"bad/{hosts.kind}/{i}".encode() for i in range(5)]
        good = [bytes(encode_value(k, row)) for k in keys]
        corrupt = bytearray(good[0])
        corrupt[HEADER_BYTES + len(keys[0]) + 1000] ^= 1
        other_version = bytearray(good[4])
        other_version[4] = 9
        values = [
            bytes(corrupt),  # one bit of the row flipped
            good[1][: len(good[1]) // 2],  # truncated
            bytes(encode_value(keys[2][:-1] + b"X", row)),  # another block's (same length)
            bytes(encode_value(keys[3], row[: len(row) // 2])),  # a row of another size
            bytes(other_version),
        ]
        for k, v in zip(keys, values, strict=True):
            client.set(remote_key("kvd", fp, k), v)
        before = counters(hosts.b.daemon).get("remote.bad_values", 0)
        for k in keys:
            assert e.scheduler.lookup([k]) is None
            wait_for("the refusal", lambda k=k: e.scheduler.lookup([k]) == 0)
        assert counters(hosts.b.daemon)["remote.bad_values"] - before == len(keys)
        (info,) = [pi for pi in e.scheduler.stats().pools if pi.name == pool]
        assert info.blocks_ready == 0 and info.blocks_in_flight == 0
        # The same key with a good value is served once the miss is forgotten:
        # here a fresh key, so that the daemon's memory of the miss does not apply.
        fresh = f"bad/{hosts.kind}/fresh".encode()
        client.set(remote_key("kvd", fp, fresh), bytes(encode_value(fresh, row)))
        fetch_all(e.scheduler, [fresh])
        client.close()
    finally:
        e.close()
