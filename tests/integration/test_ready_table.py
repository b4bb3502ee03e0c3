"""Runs in the test process (and reader processes it spawns): the ready table (SPEC section 15).

The writer is `kvd.io.ready_table.ReadyTableWriter` on real shared memory, as
the sink of a real `BlockIndex`; readers are `kvd_client.ready_table`
views, in this process and in others, and `Scheduler.lookup` against a real
daemon.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.index import BlockIndex
from kvd.io.ready_table import ReadyTableWriter
from kvd.io.region import Manifest
from kvd_client import Layout, Scheduler
from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.errors import ErrorCode, KvdError
from kvd_client.ready_table import (
    BUCKET_BYTES,
    EPOCH_OFFSET,
    HEADER_BYTES,
    READY,
    STALE_NS,
    STORING,
    MappedTable,
    ReadyTable,
    TableChanged,
    bucket_of,
)
from kvd_tools.launcher import DaemonProcess

LAYOUT = Layout("m", "bfloat16", 16, 1, False, 4096)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def writer(tmp_path: Path, num_blocks: int) -> ReadyTableWriter:
    return ReadyTableWriter(f"/kvd-test-{uuid.uuid4().hex[:12]}.ready", num_blocks, 7,
                            gid=None, manifest=Manifest(tmp_path / "manifest"))  # fmt: skip


# -- the table against the index it mirrors ------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "complete", "fail", "load", "unload", "reset"]),
        st.lists(st.integers(0, 40), min_size=1, max_size=8),
    ),
    max_size=60,
)


@pytest.mark.parametrize("native", [True, False], ids=["c", "python"])
@settings(max_examples=150, deadline=None)
@given(ops=ops, probes=st.lists(st.lists(st.integers(0, 40), max_size=6), max_size=8))
def test_the_table_answers_what_the_index_answers(
    tmp_path_factory: pytest.TempPathFactory,
    native: bool,
    ops: list[tuple[str, list[int]]],
    probes: list[list[int]],
) -> None:
    table = writer(tmp_path_factory.mktemp("t"), 8)
    try:
        index = BlockIndex(8)
        index.sink = table
        reader = ReadyTable(table._mm)
        if native and not reader.native:
            pytest.skip("the C probe loop was not built")
        reader.native = native
        for op, ids in ops:
            keys = list(dict.fromkeys(key(i) for i in ids))
            try:
                if op == "store":
                    index.prepare_store(keys)
                elif op in ("complete", "fail"):
                    index.complete_store([k for k in keys if k in index], op == "complete")
                elif op == "load":
                    index.prepare_load(keys)
                elif op == "unload":
                    index.complete_load(keys)
                else:
                    index.reset()
            except Exception:  # the index refused the batch and changed nothing
                pass
            for ids_ in probes:
                ks = [key(i) for i in ids_]
                assert reader.lookup(ks) == index.lookup(ks), (op, ids, ids_)
            for k in (key(i) for i in range(41)):
                want = (READY if index.is_ready(k) else STORING) if k in index else 0
                assert reader.state(k) == want
    finally:
        table.close()


def test_churn_leaves_no_tombstone_and_keeps_every_answer(tmp_path: Path) -> None:
    table = writer(tmp_path, 64)
    try:
        index = BlockIndex(64)
        index.sink = table
        reader = ReadyTable(table._mm)
        for n in range(0, 4000, 16):  # every batch evicts: deletions shift clusters back
            batch = [key(i) for i in range(n, n + 16)]
            assert index.prepare_store(batch) is not None
            index.complete_store(batch)
        assert reader.epoch() == 0  # no reset, and no rebuild ever stops the readers
        states = [table._mm[64 + i * 72 + 4] for i in range(table.num_buckets)]
        assert states.count(READY) == 64 and set(states) <= {0, READY}
        live = [key(i) for i in range(4000 - 64, 4000)]
        assert all(reader.state(k) == READY for k in live)
        assert reader.lookup([key(i) for i in range(4000 - 200, 4000)]) == 0
        assert reader.lookup(live) == 64
    finally:
        table.close()


# -- readers in other processes, a writer at full speed -------------------------------


def wide_key(i: int) -> bytes:
    """A 36-byte key, as vLLM's; keys differ only in their last bytes."""
    return b"\x5a" * 28 + i.to_bytes(8, "big")


ROUND = 4  # keys stored a round; the pool holds four rounds (16 blocks, 32 buckets)


def _reader(name: str, round_: mp.Value, out: mp.Queue, seconds: float, native: bool) -> None:  # type: ignore[type-arg]
    """Looks up, one at a time, the keys of the last eight rounds: half in the
    pool, half just evicted (their buckets reused by new keys that differ only in
    their last bytes). Reports (t_start, t_end, key id) of every hit, and of
    every answer "being stored" (None)."""
    from kvd_client.ready_table import MappedTable, TableChanged

    table = MappedTable(name)
    table.native = native and table.native
    hits, storing, reads = [], [], 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        r = round_.value
        for i in range(max(0, r - 8) * ROUND, r * ROUND):
            t0 = time.monotonic()
            try:
                found = table.lookup([wide_key(i)])
            except TableChanged:
                continue
            reads += 1
            if found:
                hits.append((t0, time.monotonic(), i))
            elif found is None:
                storing.append((t0, time.monotonic(), i))
    out.put((reads, hits, storing))


def test_readers_in_other_processes_never_see_a_hit_that_was_not_ready(tmp_path: Path) -> None:
    """Every hit a reader reports was ready at some moment of its read: checked
    against the writer's own times of completion and eviction."""
    table = writer(tmp_path, 4 * ROUND)
    ctx = mp.get_context("spawn")
    round_ = ctx.Value("q", 0)
    out, victim_out = ctx.Queue(), ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(table.name, round_, out, 4.0, native))
               for native in (True, True, False)]  # fmt: skip
    victim = ctx.Process(target=_reader, args=(table.name, round_, victim_out, 30.0, True))
    ready_from: dict[int, float] = {}  # key id -> when complete_store began
    gone_by: dict[int, float] = {}  # key id -> when the call that evicted or failed it returned
    stored_from: dict[int, float] = {}  # key id -> when prepare_store began
    stored_by: dict[int, float] = {}  # key id -> when its complete_store returned
    try:
        index = BlockIndex(4 * ROUND)
        index.sink = table
        for proc in [*readers, victim]:
            proc.start()
        time.sleep(1.0)  # the readers import and map
        deadline = time.monotonic() + 4.0
        r = 0
        while time.monotonic() < deadline:
            ids = range(r * ROUND, (r + 1) * ROUND)
            for i in ids:
                stored_from[i] = time.monotonic()
            out_ = index.prepare_store([wide_key(i) for i in ids])
            assert out_ is not None
            now = time.monotonic()
            for k in out_.evicted_keys:
                gone_by[int.from_bytes(k[-8:], "big")] = now
            ok = r % 10 != 3  # some stores fail: never ready
            t = time.monotonic()
            index.complete_store([wide_key(i) for i in ids], ok)
            for i in ids:
                stored_by[i] = time.monotonic()
                if ok:
                    ready_from[i] = t
                else:
                    gone_by[i] = time.monotonic()
            r += 1
            round_.value = r
            table.beat()  # as the daemon's ticks do
            if r == 500:
                assert victim.is_alive(), "the reader to kill never ran"
                os.kill(victim.pid or 0, signal.SIGKILL)  # a reader dies mid-read
        results = [out.get(timeout=30) for _ in readers]
    finally:
        for proc in [*readers, victim]:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        table.close()
    assert r > 1000, "the writer barely ran"
    assert all(reads > 10_000 for reads, _, _ in results), "a reader barely ran"
    hits = [h for _, found, _ in results for h in found]
    assert len(hits) > 1000, "no hits: the check proves nothing"
    for t0, t1, i in hits:
        assert i in ready_from, f"key {i} reported ready, never completed"
        assert ready_from[i] <= t1, f"key {i} hit before it became ready"
        assert gone_by.get(i, float("inf")) >= t0, f"key {i} hit after it was gone"
    for t0, t1, i in (x for _, _, storing in results for x in storing):
        assert stored_from[i] <= t1, f"key {i} 'being stored' before its store began"
        assert stored_by.get(i, float("inf")) >= t0, f"key {i} 'being stored' after it ended"


# -- through the daemon ------------------------------------------------------------------


def observed(d: DaemonProcess) -> int:
    conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        reply = conn.call(p.Stats)
        assert isinstance(reply, p.StatsResult)
        return int(reply.counters.get("observed_lookups", 0))
    finally:
        conn.close()


def test_scheduler_lookups_from_the_table_match_the_daemon_and_are_reported() -> None:
    with (
        DaemonProcess() as d, Scheduler("p", LAYOUT, engine_id="a", endpoint=d.endpoint,
                  capacity_bytes=64 * 4096) as s,
        Scheduler("p", LAYOUT, engine_id="b", endpoint=d.endpoint, use_table=False) as rpc,
    ):  # fmt: skip
        assert s.table is not None and rpc.table is None
        mode = stat.S_IMODE(os.stat("/dev/shm" + s.table.name).st_mode)
        assert mode == 0o600  # no service group here: owner only, like the pool
        with pytest.raises(TypeError):
            s.table.buf[0] = 1  # type: ignore[index]  # mapped read-only
        keys = [key(i) for i in range(48)]
        assert s.prepare_store(keys[:40]) is not None
        s.complete_store(keys[:32])
        assert observed(d) == 0
        for probe in (keys, keys[:32], keys[32:], keys[40:], keys[:8] + keys[40:]):
            assert s.lookup(probe) == rpc.lookup(probe)
        deadline = time.monotonic() + 5
        while observed(d) < 5 and time.monotonic() < deadline:  # sent, not waited for
            time.sleep(0.01)
        assert observed(d) == 5  # every table lookup reached the daemon, once, by itself
        # prepare_load stays authoritative: a key evicted since the lookup is refused.
        assert s.lookup(keys[:4]) == 4
        s.complete_store(keys[32:40])
        fresh = [key(i) for i in range(1000, 1064)]
        out = s.prepare_store(fresh)  # the whole pool: everything before goes
        assert out is not None and set(keys[:4]) <= set(out.evicted_keys)
        with pytest.raises(KvdError) as err:
            s.prepare_load(keys[:4])
        assert err.value.code == ErrorCode.MISSING
        assert s.lookup(keys[:4]) == 0


def test_a_store_of_keys_all_ready_is_answered_from_the_table() -> None:
    """`prepare_store` of keys the table shows all ready stores nothing (SPEC: keys
    present are skipped) and asks the daemon nothing: it answers with the daemon
    stopped. A key not ready still goes to the daemon."""
    with (
        DaemonProcess(lease_ms="10000") as d,
        Scheduler("p", LAYOUT, engine_id="a", endpoint=d.endpoint, capacity_bytes=64 * 4096) as s,
    ):
        keys = [key(i) for i in range(8)]
        out = s.prepare_store(keys)
        assert out is not None and list(out.keys_to_store) == keys
        s.complete_store(keys[:6])
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            out = s.prepare_store(keys[:6])
            took = time.monotonic() - t0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert out is not None, "the store went to the stopped daemon"
        assert (list(out.keys_to_store), out.store_spec.slots, list(out.evicted_keys)) == (
            [],
            [],
            [],
        )
        assert took < 0.1 and s.connected
        out = s.prepare_store([*keys[:6], key(100)])  # one key not ready: the daemon's answer
        assert out is not None and list(out.keys_to_store) == [key(100)]
        assert s.prepare_store(keys[5:7]) is not None  # one in flight: the daemon skips it
        s.complete_store([key(100)])
        assert s.lookup([*keys[:6], key(100)]) == 7


def test_no_table_means_the_round_trip_and_the_same_answers() -> None:
    with (
        DaemonProcess(ready_tables="false") as d,
        Scheduler("p", LAYOUT, engine_id="a", endpoint=d.endpoint, capacity_bytes=64 * 4096) as s,
    ):
        assert s.attached is not None and s.attached.ready_table == ""
        assert s.table is None
        keys = [key(i) for i in range(8)]
        assert s.prepare_store(keys) is not None
        s.complete_store(keys[:4])
        assert s.lookup(keys) is None and s.lookup(keys[:4]) == 4


def test_a_restarted_daemon_publishes_a_new_table_and_the_scheduler_maps_it() -> None:
    d = DaemonProcess(lease_ms="3000", restart="cold").start()
    try:
        with Scheduler("p", LAYOUT, engine_id="a", endpoint=d.endpoint,
                       capacity_bytes=64 * 4096) as s:  # fmt: skip
            assert s.table is not None
            old, epoch = s.table.name, s.epoch
            keys = [key(i) for i in range(8)]
            assert s.prepare_store(keys) is not None
            s.complete_store(keys)
            assert s.lookup(keys) == 8
            d.kill(signal.SIGKILL)
            assert os.path.exists("/dev/shm" + old)  # a killed daemon unlinks nothing
            d.start()  # cold: the old segments go, the pool and its table are new
            assert not os.path.exists("/dev/shm" + old)
            deadline = time.monotonic() + 30
            while not (s.connected and s.epoch > epoch):
                assert time.monotonic() < deadline, "the scheduler never reconnected"
                time.sleep(0.05)
            assert s.table is not None and s.table.name != old
            assert s.lookup(keys) == 0
    finally:
        d.stop()


def test_a_table_that_cannot_be_mapped_falls_back_to_the_round_trip() -> None:
    with pytest.raises(ValueError, match="not a kvd ready table"):
        ReadyTable(bytes(128))
    with DaemonProcess() as d:
        with Scheduler("p", LAYOUT, engine_id="a", endpoint=d.endpoint,
                       capacity_bytes=64 * 4096) as s:  # fmt: skip
            assert s.table is not None
            name = s.table.name
        os.unlink("/dev/shm" + name)  # as if on another host: the name maps to nothing
        with pytest.raises(OSError):
            MappedTable(name)
        with Scheduler("p", LAYOUT, engine_id="b", endpoint=d.endpoint) as s:
            assert s.attached is not None and s.attached.ready_table == name
            assert s.table is None
            keys = [key(i) for i in range(4)]
            assert s.prepare_store(keys) is not None
            s.complete_store(keys)
            assert s.lookup(keys) == 4 and s.lookup(keys[1:]) == 3


def test_a_dropped_pools_table_answers_nothing() -> None:
    with DaemonProcess() as d, Scheduler("p", LAYOUT, engine_id="a", endpoint=d.endpoint,
                   capacity_bytes=64 * 4096) as s:  # fmt: skip
        keys = [key(i) for i in range(4)]
        assert s.prepare_store(keys) is not None
        s.complete_store(keys)
        table = s.table
        assert table is not None and table.lookup(keys) == 4
        conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=2000)
        conn.connect()
        try:
            assert isinstance(conn.call(p.DropPool, "p", d.admin_token), p.Ok)
        finally:
            conn.close()
        assert not os.path.exists("/dev/shm" + table.name)
        with pytest.raises(TableChanged):  # still mapped here, but marked dead
            table.lookup(keys)
        assert s.lookup(keys) == 0  # the round trip: the pool is gone


def test_a_dead_daemons_table_stops_answering_within_its_staleness() -> None:
    d = DaemonProcess().start()
    try:
        with Scheduler("p", LAYOUT, engine_id="a", endpoint=d.endpoint,
                       capacity_bytes=64 * 4096) as s:  # fmt: skip
            keys = [key(i) for i in range(4)]
            assert s.prepare_store(keys) is not None
            s.complete_store(keys)
            time.sleep(1.0)  # the daemon keeps the table alive meanwhile
            assert s.lookup(keys) == 4
            d.kill(signal.SIGKILL)
            t0 = time.monotonic()
            table = s.table
            assert table is not None
            while True:  # no other call: only the table's staleness can tell
                try:
                    table.lookup(keys)
                except TableChanged:
                    break
                assert time.monotonic() - t0 < STALE_NS / 1e9 + 1.0
                time.sleep(0.05)
            assert s.lookup(keys) == 0  # the round trip, to a dead daemon: a miss
    finally:
        d.stop()


def test_a_warm_fill_writes_the_table_the_python_writer_would(tmp_path: Path) -> None:
    """`ReadyTableWriter.adopted` in C (`kvd_client._warmstart.fill`): the same
    buckets as one `ready` per key in Python taken in the C's order (by the
    home bucket's top 16 bits, stably), and readers find every key. It runs on
    a thread, under an odd epoch until it is done: readers ask the daemon."""
    warmstart = pytest.importorskip("kvd_client._warmstart")
    keys = [key(i) for i in range(300)] + [b"x" * 64, b"y"]
    fast, slow = writer(tmp_path, 400), writer(tmp_path, 400)
    try:
        assert warmstart.fill(fast._mm, [], fast._mask) == 0
        fast.adopted(keys)
        assert fast._filling is not None
        fast.wait_filled()
        assert fast._filling is None and fast._mm[EPOCH_OFFSET] == 2  # odd while filling, even now
        shift = max(fast._mask.bit_length() - 16, 0)
        slow.set_states(sorted(keys, key=lambda k: bucket_of(k, slow._mask) >> shift), READY)
        for b in range(fast.num_buckets):  # each bucket but its (even) sequence counter
            at = HEADER_BYTES + b * BUCKET_BYTES
            assert fast._mm[at + 4 : at + BUCKET_BYTES] == slow._mm[at + 4 : at + BUCKET_BYTES]
            assert fast._mm[at] % 2 == 0
        assert fast._live == slow._live == len(keys)
        table = ReadyTable(bytes(fast._mm))  # a copy: the mapping closes below
        assert table.lookup(keys) == len(keys)
        with pytest.raises(RuntimeError, match="empty ready table"):
            fast.adopted([b"more"])
        with pytest.raises(ValueError, match="half full"):
            warmstart.fill(bytearray(HEADER_BYTES + 4 * 72), [b"1", b"2", b"3", b"4"], 3)
        empty = bytearray(HEADER_BYTES + 8 * 72)
        with pytest.raises(TypeError, match="list of bytes"):
            warmstart.fill(empty, [b"1", "two"], 7)
        assert empty == bytearray(len(empty))  # nothing written
    finally:
        fast.close()
        slow.close()


def test_a_big_warm_fill_runs_beside_the_loop_and_writes_wait_for_it(tmp_path: Path) -> None:
    """While a warm fill runs, lookups of the table raise `TableChanged` (the
    client asks the daemon instead), never a wrong answer; a write waits for
    the fill, then lands; the table then answers every key."""
    pytest.importorskip("kvd_client._warmstart")
    n = 200_000
    keys = [key(i) for i in range(n)]
    w = writer(tmp_path, n + 10)
    try:
        w.adopted(keys)
        reader = ReadyTable(w._mm)
        answers = set()
        while w._filling is not None and w._filling.is_alive():
            try:
                answers.add(reader.lookup(keys[:1]))
            except TableChanged:
                answers.add("asks the daemon")
        assert answers <= {"asks the daemon", 1}
        w.set_states([b"new"], STORING)  # waits for the fill first
        assert w._filling is None
        assert reader.lookup(keys) == n
        assert reader.lookup([b"new"]) is None  # being stored
    finally:
        w.close()


def test_a_failed_warm_fill_leaves_readers_asking_the_daemon_until_a_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fill that raises (a bug, not a state) is logged; the table then never
    answers (its epoch stays odd: readers ask the daemon), until a reset
    writes every bucket again."""
    from kvd.io import ready_table

    class Broken:
        @staticmethod
        def fill(*args: object) -> int:
            raise RuntimeError("broken on purpose")

    monkeypatch.setattr(ready_table, "_warmstart", Broken)
    w = writer(tmp_path, 100)
    try:
        with caplog.at_level("ERROR", logger="kvd.io.ready_table"):
            w.adopted([key(i) for i in range(10)])
            w.wait_filled()
        assert "event=ready_table_fill_failed" in caplog.text
        reader = ReadyTable(w._mm)
        with pytest.raises(TableChanged):
            reader.lookup([key(1)])
        w.set_states([key(50)], READY)
        with pytest.raises(TableChanged):
            reader.lookup([key(50)])
        w.reset()
        w.set_states([key(51)], READY)
        assert reader.lookup([key(51)]) == 1
        assert reader.lookup([key(1)]) == 0
    finally:
        w.close()
