"""Runs in the test process: the daemon end to end over ipc:// (issue: the daemon)."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time

import pytest
import zmq

from kvd_client import Layout, Scheduler
from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.errors import ErrorCode, KvdError
from kvd_tools.launcher import DaemonProcess
from tests.integration.conftest import python_child

MHA_ARGS = ("demo-model@1", "bfloat16", 16, 2, False, 64 << 10)
MHA = Layout(*MHA_ARGS)
MLA = Layout("demo-mla@1", "bfloat16", 16, 2, True, 64 << 10)


def keys(n: int, start: int = 0) -> list[bytes]:
    return [(start + i).to_bytes(8, "big") for i in range(n)]


def admin(d: DaemonProcess) -> Connection:
    conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    return conn


def pool_info(d: DaemonProcess, name: str) -> p.PoolInfo:
    conn = admin(d)
    try:
        reply = conn.call(p.Pools)
        assert isinstance(reply, p.PoolsResult)
        return next(pi for pi in reply.pools if pi.name == name)
    finally:
        conn.close()


def test_attach_geometry_sharded_vs_replicated(daemon: DaemonProcess) -> None:
    cap = 8 << 20
    with (
        Scheduler("mha", MHA, engine_id="e1", endpoint=daemon.endpoint, capacity_bytes=cap) as s1,
        Scheduler("mla", MLA, engine_id="e2", endpoint=daemon.endpoint, capacity_bytes=cap) as s2,
    ):
        a1, a2 = s1.attached, s2.attached
        assert a1 is not None and a2 is not None
        assert (a1.num_slots, a2.num_slots) == (2, 1)
        assert a1.slot_stride == a2.slot_stride == 64 << 10
        assert a1.row_bytes == 2 * a1.slot_stride and a2.row_bytes == a2.slot_stride
        assert a1.num_blocks == cap // (128 << 10)
        assert a2.num_blocks == MLA.world_size * a1.num_blocks
        assert a1.shm_name.startswith("/kvd.mha.")
        assert os.path.exists("/dev/shm" + a1.shm_name)


def test_layout_mismatch_reuse_and_drop(daemon: DaemonProcess) -> None:
    with Scheduler("p", MHA, engine_id="a", endpoint=daemon.endpoint) as a:
        assert a.prepare_store(keys(3)) is not None
        a.complete_store(keys(3))
        other = Layout("other-model", "bfloat16", 16, 2, False, 64 << 10)
        with pytest.raises(KvdError) as err:
            Scheduler("p", other, engine_id="b", endpoint=daemon.endpoint)
        assert err.value.code == ErrorCode.LAYOUT_MISMATCH
        with Scheduler("p", MHA, engine_id="c", endpoint=daemon.endpoint) as c:
            assert c.attached is not None and a.attached is not None
            assert c.attached.shm_name == a.attached.shm_name
            assert c.lookup(keys(3)) == 3
        shm = a.attached.shm_name
    conn = admin(daemon)
    try:
        with pytest.raises(KvdError) as err:  # a group member without the token
            conn.call(p.DropPool, "p")
        assert err.value.code == ErrorCode.WRONG_ROLE and "admin.token" in str(err.value)
        with pytest.raises(KvdError) as err:
            conn.call(p.DropPool, "p", "not-the-token")
        assert err.value.code == ErrorCode.WRONG_ROLE
        conn.call(p.DropPool, "p", daemon.admin_token)
        with pytest.raises(KvdError) as err:
            conn.call(p.DropPool, "p", daemon.admin_token)
        assert err.value.code == ErrorCode.NO_SUCH_POOL
    finally:
        conn.close()
    assert not os.path.exists("/dev/shm" + shm)


def test_engines_of_other_kv_cache_groups_never_share_a_pool(daemon: DaemonProcess) -> None:
    sliding = p.Group("sliding_window", 16, sliding_window=128)
    full = p.Group("full_attention", 16)
    hybrid = Layout(*MHA_ARGS, groups=(sliding, full))
    with Scheduler("hybrid", hybrid, engine_id="a", endpoint=daemon.endpoint) as a:
        assert a.attached is not None
        for groups in [(), (full,), (full, sliding), (p.Group("sliding_window", 16, 64), full)]:
            with pytest.raises(KvdError) as err:
                Scheduler("hybrid", Layout(*MHA_ARGS, groups=groups), engine_id="b",
                          endpoint=daemon.endpoint)  # fmt: skip
            assert err.value.code == ErrorCode.LAYOUT_MISMATCH
        with Scheduler("hybrid", Layout(*MHA_ARGS, groups=(sliding, full)), engine_id="c",
                       endpoint=daemon.endpoint) as c:  # fmt: skip
            assert c.attached is not None and c.attached.shm_name == a.attached.shm_name


def test_two_scheduler_processes_share_a_pool(daemon: DaemonProcess, spawn: list) -> None:
    code = f"""
from kvd_client import Layout, Scheduler
with Scheduler("shared", Layout(*{MHA_ARGS!r}), engine_id="writer", endpoint={daemon.endpoint!r}) as s:
    ks = [i.to_bytes(8, "big") for i in range(10)]
    out = s.prepare_store(ks)
    assert out is not None and out.keys_to_store == ks
    s.complete_store(ks)
    print("stored", flush=True)
"""
    child = python_child(code)
    spawn.append(child)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.strip() == "stored"
    with Scheduler("shared", MHA, engine_id="reader", endpoint=daemon.endpoint) as s:
        assert s.lookup(keys(10)) == 10
        assert s.lookup(keys(12)) == 10
        assert s.lookup(keys(5, start=100)) == 0
        spec = s.prepare_load(keys(4))
        assert len(spec.slots) == 4
        s.complete_load(keys(4))


def test_killed_client_is_rolled_back_within_three_leases(
    daemon: DaemonProcess, spawn: list
) -> None:
    with Scheduler("roll", MHA, engine_id="setup", endpoint=daemon.endpoint) as s:
        s.prepare_store(keys(4))
        s.complete_store(keys(4))
    code = f"""
import sys, time
from kvd_client import Layout, Scheduler
s = Scheduler("roll", Layout(*{MHA_ARGS!r}), engine_id="victim", endpoint={daemon.endpoint!r})
ks = [i.to_bytes(8, "big") for i in range(4)]
s.prepare_load(ks); s.prepare_load(ks[:2])
s.prepare_store([i.to_bytes(8, "big") for i in range(100, 106)])
print("holding", flush=True)
time.sleep(600)
"""
    child = python_child(code)
    spawn.append(child)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "holding"
    info = pool_info(daemon, "roll")
    assert (info.blocks_pinned, info.blocks_in_flight) == (4, 6)
    child.kill()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3 * daemon.lease_s + 0.5:
        info = pool_info(daemon, "roll")
        if info.blocks_pinned == 0 and info.blocks_in_flight == 0:
            break
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    assert (info.blocks_pinned, info.blocks_in_flight) == (0, 0)
    # One lease to expire, one more in which its engine might still be copying.
    assert daemon.lease_s <= elapsed <= 3 * daemon.lease_s
    assert info.blocks_ready == 4 and info.blocks_free == info.num_blocks - 4
    with Scheduler("roll", MHA, engine_id="after", endpoint=daemon.endpoint) as s:
        assert s.lookup(keys(4)) == 4
        assert s.lookup([(100).to_bytes(8, "big")]) == 0
        assert s.check_invariants() == []


def test_daemon_killed_and_restarted_client_recovers(daemon: DaemonProcess) -> None:
    s = Scheduler("warm", MHA, engine_id="e", endpoint=daemon.endpoint, timeout_ms=300)
    try:
        assert s.prepare_store(keys(2)) is not None
        s.complete_store(keys(2))
        daemon.kill()
        # Meanwhile: misses and no-ops, never an exception.
        for _ in range(3):
            # The first call to time out (a key not in the table, which answers a store
            # of keys all ready with no round trip), then no calls: disconnected.
            assert s.prepare_store(keys(3)) is None
            assert s.prepare_store(keys(2)) is None
            assert s.lookup(keys(2)) == 0  # then a lookup, from the table or not
            assert s.store(keys(2), [0, 1]) is None
            s.touch(keys(2))
            s.complete_store(keys(2))
        assert not s.connected
        daemon.start()
        deadline = time.monotonic() + 10
        while not s.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.connected
        assert s.lookup(keys(2)) == 2  # a restarted daemon adopts its pools warm (SPEC 13)
        # Stores are served at once (only slots a dead daemon's job may touch are held).
        out = s.prepare_store(keys(2))
        assert out is not None and out.keys_to_store == []  # both are there already
        out = s.prepare_store(keys(4))
        assert out is not None and out.keys_to_store == keys(4)[2:]
        s.complete_store(keys(4))
        assert s.lookup(keys(4)) == 4
    finally:
        s.close()


def test_not_owner_and_pin_cap(daemon: DaemonProcess) -> None:
    small = Layout("m", "bfloat16", 16, 1, False, 4096)
    cap = 16 * 4096  # 16 blocks, pin cap = half
    with (
        Scheduler("own", small, engine_id="a", endpoint=daemon.endpoint, capacity_bytes=cap) as a,
        Scheduler("own", small, engine_id="b", endpoint=daemon.endpoint) as b,
    ):
        assert a.prepare_store(keys(12)) is not None
        with pytest.raises(KvdError) as err:
            b.complete_store(keys(1))
        assert err.value.code == ErrorCode.NOT_OWNER
        a.complete_store(keys(12))
        a.prepare_load(keys(2))
        with pytest.raises(KvdError) as err:
            b.complete_load(keys(1))
        assert err.value.code == ErrorCode.NOT_OWNER
        a.complete_load(keys(2))
        a.prepare_load(keys(8))
        with pytest.raises(KvdError) as err:
            a.prepare_load(keys(1, start=8))
        assert err.value.code == ErrorCode.PIN_LIMIT
        b.prepare_load(keys(8))  # the cap is per session
        a.complete_load(keys(8))
        with pytest.raises(KvdError) as err:
            a.prepare_load([b"\xff" * 8])
        assert err.value.code == ErrorCode.MISSING


def test_lookup_and_pin_pins_the_leading_hits_in_one_round_trip(daemon: DaemonProcess) -> None:
    small = Layout("m", "bfloat16", 16, 1, False, 4096)
    with Scheduler(
        "pin", small, engine_id="a", endpoint=daemon.endpoint, capacity_bytes=4 * 4096
    ) as s:
        assert s.prepare_store(keys(3)) is not None
        s.complete_store(keys(3))
        before = pool_info(daemon, "pin").blocks_pinned
        hits, spec = s.lookup_and_pin([*keys(2), b"\xfe" * 8, *keys(1, start=2)])
        assert hits == 2 and len(spec.slots) == 2
        assert pool_info(daemon, "pin").blocks_pinned == before + 2
        out = s.prepare_store(keys(2, start=10))  # one free, one evictable: the pinned stay
        assert out is not None and not set(out.evicted_keys) & set(keys(2))
        assert s.lookup_and_pin([b"\xfe" * 8]) == (0, type(spec)([]))
        s.complete_load(keys(2))
        assert pool_info(daemon, "pin").blocks_pinned == before


def test_complete_load_without_waiting_releases_in_order_and_logs_a_refusal(
    daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The vLLM connector releases a finished load's pins without waiting for the
    reply (`wait=False`): the daemon takes it before the session's next request,
    and a refusal, which nobody waits to see, is logged, not lost."""
    small = Layout("m", "bfloat16", 16, 1, False, 4096)
    with (
        Scheduler(
            "nowait", small, engine_id="a", endpoint=daemon.endpoint, capacity_bytes=8 * 4096
        ) as a,  # fmt: skip
        Scheduler("nowait", small, engine_id="b", endpoint=daemon.endpoint) as b,
    ):
        assert a.prepare_store(keys(4)) is not None
        a.complete_store(keys(4))
        before = pool_info(daemon, "nowait").blocks_pinned
        a.prepare_load(keys(4))
        assert pool_info(daemon, "nowait").blocks_pinned == before + 4
        a.complete_load(keys(4), wait=False)
        a.touch(keys(4), wait=False)
        # The next request of the session: answered after the release.
        assert a.prepare_load(keys(1)).slots
        assert pool_info(daemon, "nowait").blocks_pinned == before + 1
        a.complete_load(keys(1), wait=False)
        with caplog.at_level("WARNING", logger="kvd_client"):
            b.complete_load(keys(1), wait=False)  # not b's pin: NOT_OWNER, not raised
            b.stats()  # reads the refusal
        assert any("refused a CompleteLoad" in r.getMessage() and "NOT_OWNER" in
                   r.getMessage().upper() for r in caplog.records), caplog.text  # fmt: skip
        a.stats()
        assert pool_info(daemon, "nowait").blocks_pinned == before


def test_a_release_the_daemon_cannot_take_never_blocks_the_engine() -> None:
    """A stopped daemon: releases sent without waiting fill the socket's queue
    (about a thousand), the one that finds it full goes as a call, which gives
    up within the timeout (300 ms) and drops the session (the daemon rolls its
    pins back), and the engine's thread goes on; the keeper's heartbeat, which
    would notice later (a third of the 10 s lease), is not what ends it."""
    with DaemonProcess(lease_ms="10000") as daemon:
        _release_against_a_stopped_daemon(daemon)


def _release_against_a_stopped_daemon(daemon: DaemonProcess) -> None:
    small = Layout("m", "bfloat16", 16, 1, False, 4096)
    with Scheduler("stuck", small, engine_id="a", endpoint=daemon.endpoint, timeout_ms=300,
                   capacity_bytes=8 * 4096) as s:  # fmt: skip
        assert s.prepare_store(keys(1)) is not None
        s.complete_store(keys(1))
        s.prepare_load(keys(1))
        assert daemon.proc is not None
        done: list[float] = []

        def release() -> None:
            t0 = time.monotonic()
            while s.connected and time.monotonic() - t0 < 20:
                s.complete_load(keys(1), wait=False)
            done.append(time.monotonic() - t0)

        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=release, daemon=True)
            thread.start()
            thread.join(timeout=40)
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert done and done[0] < 2, f"releases held the engine's thread {done or 'forever'}"
        assert not s.connected  # dropped; the keeper reconnects
        deadline = time.monotonic() + 10
        while not s.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.connected


def test_permissions(tmp_path: object) -> None:
    d = DaemonProcess(group="root").start()
    try:
        with Scheduler("perm", MHA, engine_id="e", endpoint=d.endpoint) as s:
            assert s.attached is not None
            shm = os.stat("/dev/shm" + s.attached.shm_name)
        assert stat.S_IMODE(os.stat(d.runtime_dir).st_mode) == 0o750
        sock = os.stat(d.runtime_dir / "control.sock")
        assert stat.S_IMODE(sock.st_mode) == 0o660 and sock.st_gid == 0
        assert stat.S_IMODE(shm.st_mode) == 0o660 and shm.st_gid == 0
    finally:
        d.stop()
    d = DaemonProcess().start()
    try:
        with Scheduler("perm", MHA, engine_id="e", endpoint=d.endpoint) as s:
            assert s.attached is not None
            assert stat.S_IMODE(os.stat("/dev/shm" + s.attached.shm_name).st_mode) == 0o600
    finally:
        d.stop()


@pytest.mark.parametrize("daemon", [{"restart": "cold"}], indirect=True)
def test_sigterm_unlinks_segments_and_exits_zero(daemon: DaemonProcess) -> None:
    with Scheduler("bye", MHA, engine_id="e", endpoint=daemon.endpoint) as s:
        assert s.attached is not None
        shm = s.attached.shm_name
        s.prepare_store(keys(3))  # left in flight on purpose
        assert daemon.kill(15) == 0
    assert not os.path.exists("/dev/shm" + shm)
    assert daemon.segments() == []


@pytest.mark.parametrize("daemon", [{"restart": "cold"}], indirect=True)
def test_restart_unlinks_stale_segments(daemon: DaemonProcess) -> None:
    with Scheduler("stale", MHA, engine_id="e", endpoint=daemon.endpoint) as s:
        assert s.attached is not None
        shm = s.attached.shm_name
    daemon.kill()
    assert os.path.exists("/dev/shm" + shm)
    daemon.start()
    assert not os.path.exists("/dev/shm" + shm)


def test_unsupported_version_and_hello_first(daemon: DaemonProcess) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    try:
        sock.send(p.encoder.encode(p.Lookup(7, [b"k"])))
        assert sock.poll(5000)
        reply = p.reply_decoder.decode(sock.recv())
        assert isinstance(reply, p.Error)
        assert (reply.req_id, reply.code) == (7, ErrorCode.NOT_HELLO)
        sock.send(p.encoder.encode(p.Hello(8, 999, "admin")))
        assert sock.poll(5000)
        reply = p.reply_decoder.decode(sock.recv())
        assert isinstance(reply, p.Error)
        assert (reply.req_id, reply.code) == (8, ErrorCode.UNSUPPORTED_VERSION)
        sock.send(p.encoder.encode(p.Hello(8, 1, "admin")))  # before data_offset: refused
        assert sock.poll(5000)
        reply = p.reply_decoder.decode(sock.recv())
        assert isinstance(reply, p.Error) and reply.code == ErrorCode.UNSUPPORTED_VERSION
        sock.send(p.encoder.encode(p.Hello(9, p.PROTOCOL_VERSION, "admin")))
        assert sock.poll(5000)
        assert isinstance(p.reply_decoder.decode(sock.recv()), p.Welcome)
    finally:
        sock.close()


def test_adaptive_replays_lookups_while_the_daemon_is_idle(daemon: DaemonProcess) -> None:
    """The default policy queues lookups; the daemon replays them once idle (1 ms)."""

    def idle_steps() -> int:
        conn = admin(daemon)
        try:
            stats = conn.call(p.Stats)
            assert isinstance(stats, p.StatsResult)
            return stats.counters.get("idle_steps", 0)
        finally:
            conn.close()

    with Scheduler(
        "idle", MHA, engine_id="e", endpoint=daemon.endpoint, capacity_bytes=8 << 20
    ) as s:
        assert pool_info(daemon, "idle").policy == "adaptive"
        before = idle_steps()
        for i in range(5):  # five different lookups, each queued
            assert s.lookup(keys(4, 100 * i)) == 0
        s.lookup(keys(4, 400))  # the same as the last one: counted once
        deadline = time.monotonic() + 10
        while idle_steps() - before < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert idle_steps() - before == 5
        conn = admin(daemon)
        try:
            reply = conn.call(p.CheckInvariants, daemon.admin_token)
            assert isinstance(reply, p.InvariantsResult) and reply.problems == []
        finally:
            conn.close()
