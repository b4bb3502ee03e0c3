"""Runs in the test process: the cache survives the daemon (SPEC section 13).

A real daemon, real engine processes (`torn_read_engine`, which stores, evicts
and loads blocks whose bytes are a function of their key) and real shared
memory. The daemon is SIGKILLed at random points of the workload, with the
engines, and started again on the same runtime dir; what it adopts is checked
against the engines' own records of which stores were acknowledged and which
were in flight at the kill, and every adopted block's bytes are loaded and
checked against its key.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import posix_ipc
import pytest
import torch
import zmq

from kvd_client import Layout, Scheduler, Worker
from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.segment import FORMAT_VERSION, read_segment_header
from kvd_tools.harness import block_content, contiguous_cache
from kvd_tools.launcher import DaemonProcess

ENGINE = Path(__file__).with_name("torn_read_engine.py")
TORN_LAYOUT = Layout("torn-model", "int64", 16, 1, False, 16 << 10)  # torn_read_engine's
ELEMS = (16 << 10) // 8
LAYOUT = Layout("m", "int64", 16, 1, False, 16 << 10)


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def pool_segment(d: DaemonProcess, pool: str) -> str:
    names = [n for n in d.segments() if n.startswith(f"/kvd.{pool}.") and not n.endswith(".ready")]
    assert len(names) == 1, names
    return names[0]


def ready_in_segment(shm: str) -> dict[bytes, int]:
    """The READY entries of a segment's slot table, read without writing: key -> slot."""
    from kvd.io.region import SlotTable

    seg = posix_ipc.SharedMemory(shm)
    try:
        h = read_segment_header(seg.fd)
        copy = os.memfd_create("kvd-test-copy")
        try:
            os.ftruncate(copy, h.data_offset)
            os.pwrite(copy, os.pread(seg.fd, h.data_offset, 0), 0)
            table = SlotTable(copy, h, fresh=False)
            slots, keys, _ = table.ready_entries()
            table.close()
        finally:
            os.close(copy)
    finally:
        seg.close_fd()
    return dict(zip(keys, slots, strict=True))


def admin(d: DaemonProcess) -> Connection:
    conn = Connection(d.endpoint, role="admin", keeper=False)
    conn.connect()
    return conn


def pool_info(d: DaemonProcess, pool: str) -> p.PoolInfo | None:
    conn = admin(d)
    try:
        reply = conn.call(p.Pools)
        assert isinstance(reply, p.PoolsResult)
        return next((i for i in reply.pools if i.name == pool), None)
    finally:
        conn.close()


def invariants(d: DaemonProcess) -> list[str]:
    conn = admin(d)
    try:
        reply = conn.call(p.CheckInvariants, d.admin_token)
        assert isinstance(reply, p.InvariantsResult)
        return list(reply.problems)
    finally:
        conn.close()


def kill_and_restart(d: DaemonProcess, s: Scheduler, w: Worker) -> None:
    """SIGKILLs the daemon, starts it again, and waits until both clients are back."""
    epoch = s.epoch
    d.kill(signal.SIGKILL)
    d.start()
    deadline = time.monotonic() + 30
    while not (s.connected and s.epoch > epoch and w.connected):
        assert time.monotonic() < deadline, "the clients did not come back"
        time.sleep(0.05)


def verify_loads(d: DaemonProcess, keys: list[bytes], pool: str, layout: Layout) -> int:
    """Loads every key through a real worker and checks its bytes; returns blocks verified."""
    n = max(1, len(keys))
    cache = contiguous_cache(n, layout.slot_bytes, "int64")
    with (
        Scheduler(pool, layout, engine_id="verifier", endpoint=d.endpoint) as s,
        Worker(0, 1, cache, pool=pool, layout=layout, engine_id="verifier", endpoint=d.endpoint) as w,
    ):  # fmt: skip
        for k in keys:
            assert s.lookup([k]) == 1, f"block {k.hex()} is not ready after the restart"
        verified = 0
        for first in range(0, len(keys), 16):
            batch = keys[first : first + 16]
            cache.zero_()
            job = s.load(batch, list(range(len(batch))))
            assert w.wait([job])[job]
            for i, k in enumerate(batch):
                assert torch.equal(cache[i], block_content(int.from_bytes(k, "big"), ELEMS)), (
                    f"block {k.hex()} came back with other bytes"
                )
                verified += 1
        s.finished()
    return verified


def engine(
    d: DaemonProcess, name: str, seed: int, record: Path, key_base: int
) -> subprocess.Popen[str]:
    # A 20 ms forward pass between each store's ticket and its copy: stores are
    # in flight for most of the run, as in an engine, so most kills land on one.
    args = [sys.executable, str(ENGINE), d.endpoint, name, "60", str(seed), str(record),
            str(key_base), "20"]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True, cwd=Path(__file__).parents[2])  # fmt: skip


class StoreLog:
    """What one engine's record (torn_read_engine's RECORD) says of its keys at the kill.

    `acked`: keys whose last store the worker acknowledged ok (or was about to):
    the only ones the daemon may have marked ready. `reported`: of those, the
    ones whose store the scheduler got ok: the daemon did mark them ready.
    `in_flight`: keys whose last store was under way, not acknowledged.
    `evicted`: keys its stores evicted (any engine's). `unknown`: keys of a store
    asked for whose answer never came: it may have evicted that many keys.
    """

    def __init__(self, path: Path) -> None:
        lines = path.read_text().splitlines() if path.exists() else []
        entries = []
        for n, line in enumerate(lines):
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                assert n == len(lines) - 1, f"a torn line inside {path}"
        acked_jobs = {j for e in entries for j in e.get("acked", ())}
        ok_jobs = {e["result"] for e in entries if "result" in e and e["ok"]}
        last_job: dict[int, int] = {}  # key -> the job of its last answered store
        self.evicted: set[int] = set()
        self.unknown = 0
        asked: list[int] | None = None
        for e in entries:
            if "prepare" in e:
                asked = e["prepare"]
            elif "ticket" in e:
                asked = None
                self.evicted.update(e["evicted"])
                for k in e["keys"]:
                    last_job[k] = e["ticket"]
            elif "none" in e:
                if not e["connected"]:  # it may have got through before the connection went
                    self.unknown += len(asked or ())
                asked = None  # connected: nothing fit, nothing changed
        self.unknown += len(asked or ())
        self.acked = {k for k, j in last_job.items() if j in acked_jobs}
        self.reported = {k for k, j in last_job.items() if j in ok_jobs}
        self.in_flight = set(last_job) - self.acked
        assert self.reported <= self.acked


def ready_blocks(d: DaemonProcess) -> int:
    info = pool_info(d, "torn")
    return 0 if info is None else info.blocks_ready


def stores_done(record: Path) -> int:
    """Store jobs an engine's record says the scheduler got ok."""
    try:
        return record.read_text().count('"ok": true')
    except FileNotFoundError:
        return 0


def test_sigkill_at_random_points_brings_back_exactly_the_ready_blocks(
    spawn: list, tmp_path: Path
) -> None:
    """The adopted blocks are exactly those whose stores were acknowledged: none
    in flight at the kill comes back, and none acknowledged (and not evicted)
    is lost. Each engine keeps its own keys, apart from every other engine's
    and round's, so its record alone says what became of them."""
    rng = random.Random(16)
    d = DaemonProcess(lease_ms="3000").start()
    try:
        generations = set()
        verified = 0
        in_flight_at_kills = 0
        before: dict[bytes, int] = {}  # what the last start adopted
        for kill_point in range(6):
            records = [tmp_path / f"engine-{kill_point}-{i}.jsonl" for i in range(2)]
            engines = [
                engine(d, f"engine-{kill_point}-{i}", kill_point * 10 + i, records[i],
                       (2 * kill_point + i) * 1000)
                for i in range(2)
            ]  # fmt: skip
            spawn.extend(engines)
            # Into the workload: once both engines have stored, at a random moment.
            deadline = time.monotonic() + 60
            # And the pool (48 slots, stores of up to 16 keys in flight per engine)
            # holds enough ready blocks that each kill has something to adopt.
            while min(stores_done(r) for r in records) < 5 or ready_blocks(d) < 24:
                assert time.monotonic() < deadline, "the engines never stored"
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            # Frozen first, so that their records end where the daemon's view does:
            # an engine can no longer acknowledge a store the daemon never saw.
            for e in engines:
                e.send_signal(signal.SIGSTOP)
            d.kill(signal.SIGKILL)
            for e in engines:
                e.kill()
            for e in engines:
                e.wait(timeout=20)
            shm = pool_segment(d, "torn")
            earlier = set(before)
            before = ready_in_segment(shm)
            adopted = {int.from_bytes(k, "big") for k in before}
            logs = [StoreLog(r) for r in records]
            acked = set().union(*(log.acked for log in logs))
            in_flight = set().union(*(log.in_flight for log in logs))
            in_flight_at_kills += len(in_flight)
            earlier_keys = {int.from_bytes(k, "big") for k in earlier}
            came_back = sorted(adopted & in_flight)
            assert not came_back, (
                f"round {kill_point}: stores in flight at the kill came back: {came_back}"
            )
            strays = sorted(adopted - acked - earlier_keys)
            assert not strays, f"round {kill_point}: adopted keys no store acknowledged: {strays}"
            evicted = set().union(*(log.evicted for log in logs))
            kept = (set().union(*(log.reported for log in logs)) | earlier_keys) - evicted
            lost = sorted(kept - adopted)
            unknown = sum(log.unknown for log in logs)
            assert len(lost) <= unknown, (
                f"round {kill_point}: acknowledged, not evicted, not adopted: {lost}"
            )
            d.start()
            info = pool_info(d, "torn")
            assert info is not None and info.shm_name == shm, "the pool was not adopted"
            generations.add(info.generation)
            assert info.blocks_ready == len(before) and info.blocks_in_flight == 0
            assert invariants(d) == []
            verified += verify_loads(d, list(before), "torn", TORN_LAYOUT)
            assert ready_in_segment(shm) == before  # verifying changed nothing
        assert len(generations) == 1  # one segment, adopted five times
        assert verified >= 60, f"only {verified} blocks verified over the kill points"
        # The kills did land on stores in flight, and none of those came back.
        assert in_flight_at_kills > 0, "no kill found a store in flight: nothing was shown"
        assert "event=pool_adopted pool=torn" in d.log()
    finally:
        d.stop()


def test_clients_ride_through_and_in_flight_stores_do_not_come_back() -> None:
    d = DaemonProcess(lease_ms="3000").start()
    cache = contiguous_cache(8, LAYOUT.slot_bytes, "int64")
    try:
        with (
            Scheduler("p", LAYOUT, engine_id="e", endpoint=d.endpoint,
                      capacity_bytes=32 * (16 << 10)) as s,
            Worker(0, 1, cache, pool="p", layout=LAYOUT, engine_id="e", endpoint=d.endpoint) as w,
        ):  # fmt: skip
            for i in range(4):
                cache[i] = block_content(i, ELEMS)
            ticket = s.store([key(i) for i in range(4)], list(range(4)))
            assert ticket is not None and ticket.job_id is not None
            assert w.wait([ticket.job_id])[ticket.job_id]
            deadline = time.monotonic() + 10
            while s.lookup([key(i) for i in range(4)]) != 4:
                assert time.monotonic() < deadline
                s.finished()
                time.sleep(0.01)
            in_flight = [key(i) for i in range(4, 8)]
            assert s.prepare_store(in_flight) is not None  # never completed
            mapping, generation = w._mapping, s.attached.generation
            kill_and_restart(d, s, w)
            assert s.attached.generation == generation  # the same pool, re-attached
            w.poll()
            assert w._mapping is mapping  # and the worker kept its mapping
            assert s.lookup([key(i) for i in range(8)]) == 4  # in flight: absent
            assert s.lookup(in_flight) == 0
            cache.zero_()
            job = s.load([key(i) for i in range(4)], list(range(4)))
            assert w.wait([job])[job]
            for i in range(4):
                assert torch.equal(cache[i], block_content(i, ELEMS))
    finally:
        d.stop()


def store_two(d: DaemonProcess, pool: str = "p") -> str:
    cache = contiguous_cache(2, LAYOUT.slot_bytes, "int64")
    for i in range(2):
        cache[i] = block_content(i, ELEMS)
    with (
        Scheduler(pool, LAYOUT, engine_id="e", endpoint=d.endpoint,
                  capacity_bytes=16 * (16 << 10)) as s,
        Worker(0, 1, cache, pool=pool, layout=LAYOUT, engine_id="e", endpoint=d.endpoint) as w,
    ):  # fmt: skip
        ticket = s.store([key(0), key(1)], [0, 1])
        assert ticket is not None and ticket.job_id is not None
        assert w.wait([ticket.job_id])[ticket.job_id]
        deadline = time.monotonic() + 10
        while s.lookup([key(0), key(1)]) != 2:
            assert time.monotonic() < deadline
            s.finished()
            time.sleep(0.01)
    return pool_segment(d, pool)


def test_sigterm_keeps_the_cache_and_pool_drop_frees_it() -> None:
    d = DaemonProcess().start()
    try:
        shm = store_two(d)
        assert d.kill(signal.SIGTERM) == 0
        assert os.path.exists("/dev/shm" + shm)  # kept for the next run
        d.start()
        assert verify_loads(d, [key(0), key(1)], "p", LAYOUT) == 2
        conn = admin(d)
        try:
            assert isinstance(conn.call(p.DropPool, "p", d.admin_token), p.Ok)
        finally:
            conn.close()
        assert not os.path.exists("/dev/shm" + shm)
        assert d.kill(signal.SIGTERM) == 0
        d.start()
        assert pool_info(d, "p") is None
    finally:
        d.stop()


def test_an_adopted_segment_is_prefaulted_only_when_pages_are_missing() -> None:
    """A segment whose every page is there is not walked again at a warm start
    (at 300 MB, half a second of a core); one with holes (its run had prefault
    off, or died prefaulting) is prefaulted as a new one is."""
    d = DaemonProcess(prefault="false").start()
    keys = [key(0), key(1)]

    def hits() -> int | None:
        with Scheduler("p", LAYOUT, engine_id="e", endpoint=d.endpoint,
                       capacity_bytes=64 << 20) as s:  # fmt: skip
            out = s.prepare_store(keys)  # no bytes written: the daemon never reads them
            if out is not None and out.keys_to_store:
                s.complete_store(out.keys_to_store)
            return s.lookup(keys)

    try:
        assert hits() == 2
        shm = pool_segment(d, "p")
        d.kill(signal.SIGKILL)
        st = os.stat("/dev/shm" + shm)
        assert st.st_blocks * 512 < st.st_size  # holes: never prefaulted

        def prefaults() -> int:
            return d.log_path.read_text().count(f"event=prefaulted shm={shm} ")

        d.flags["prefault"] = "true"
        d.start()
        deadline = time.monotonic() + 30
        while prefaults() < 1:
            assert time.monotonic() < deadline, "the adopted segment with holes was not prefaulted"
            time.sleep(0.05)
        assert hits() == 2
        st = os.stat("/dev/shm" + shm)
        assert st.st_blocks * 512 >= st.st_size
        d.kill(signal.SIGKILL)
        d.start()
        assert hits() == 2
        assert d.log_path.read_text().count("event=pool_adopted") == 2
        assert prefaults() == 1  # every page there: not walked again
    finally:
        d.stop()


def test_restart_cold_unlinks_at_shutdown_and_at_start() -> None:
    d = DaemonProcess(restart="cold").start()
    try:
        shm = store_two(d)
        assert d.kill(signal.SIGTERM) == 0
        assert not os.path.exists("/dev/shm" + shm)
        d.start()
        shm = store_two(d)
        d.kill(signal.SIGKILL)
        assert os.path.exists("/dev/shm" + shm)
        d.start()
        assert not os.path.exists("/dev/shm" + shm) and pool_info(d, "p") is None
        # The dead run's pool is gone: its topic starts over for an indexer.
        cleared = [e for e in replayed(d) if e["type"] == "AllBlocksCleared"]
        assert cleared, "no AllBlocksCleared for the pool a cold start unlinked"
    finally:
        d.stop()


def _rewrite_header(fd: int, change: object) -> None:
    """Changes a header field and recomputes the checksum, as another format would."""
    import zlib

    from kvd_client.segment import CRC_OFFSET, MAX_HEADER_BYTES

    raw = bytearray(os.pread(fd, MAX_HEADER_BYTES, 0))
    change(raw)  # type: ignore[operator]
    h = read_segment_header(fd)
    end = h.table_offset
    body = bytearray(raw[:end])
    struct.pack_into("<I", body, CRC_OFFSET, 0)
    name_len, layout_len = struct.unpack_from("<HH", body, 84)
    crc = zlib.crc32(bytes(body[: 136 + name_len + layout_len]))
    struct.pack_into("<I", raw, CRC_OFFSET, crc)
    os.pwrite(fd, bytes(raw[:end]), 0)


DAMAGES = {
    "magic": (lambda fd: os.pwrite(fd, b"NOTAPOOL", 0), "bad magic"),
    "checksum": (lambda fd: os.pwrite(fd, b"\xff", 30), "checksum mismatch"),
    "truncated": (lambda fd: os.ftruncate(fd, os.fstat(fd).st_size - 4096), "the header says"),
    "version": (
        lambda fd: _rewrite_header(
            fd, lambda raw: struct.pack_into("<I", raw, 8, FORMAT_VERSION + 1)
        ),
        "format version",
    ),
    "mode": (lambda fd: os.fchmod(fd, 0o644), "mode 644"),
    "owner": (lambda fd: os.fchown(fd, 4242, -1), "owned by uid 4242"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_segment_that_fails_a_check_is_unlinked_with_one_line_and_the_pool_starts_cold(
    damage: str,
) -> None:
    if damage == "owner" and os.geteuid() != 0:
        pytest.skip("changing a segment's owner takes root")
    d = DaemonProcess().start()
    try:
        shm = store_two(d)
        d.kill(signal.SIGKILL)
        do, reason = DAMAGES[damage]
        seg = posix_ipc.SharedMemory(shm)
        try:
            do(seg.fd)  # type: ignore[operator]
        finally:
            seg.close_fd()
        d.start()
        lines = [line for line in d.log().splitlines() if "event=pool_not_adopted" in line]
        assert len(lines) == 1 and "pool=p" in lines[0] and reason in lines[0], lines
        assert not os.path.exists("/dev/shm" + shm)
        assert pool_info(d, "p") is None
        with Scheduler("p", LAYOUT, engine_id="e2", endpoint=d.endpoint,
                       capacity_bytes=16 * (16 << 10)) as s:  # fmt: skip
            assert s.lookup([key(0)]) == 0 and s.attached.shm_name != shm
    finally:
        d.stop()


def test_a_bad_restart_value_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(tmp_path), "--restart", "tepid"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "restart" in lines[0], out.stderr


def replayed(d: DaemonProcess) -> list[dict]:
    """Every event the daemon's replay socket still holds, oldest first, as maps."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(f"ipc://{d.runtime_dir}/replay.sock")
        s.send((0).to_bytes(8, "big"))
        payloads = []
        while True:
            msg = s.recv_multipart()
            if msg[-2] == (-1).to_bytes(8, "big", signed=True):
                break
            payloads.append(msg[-1])
    finally:
        ctx.destroy(linger=0)
    events: list[dict] = []
    for payload in payloads:
        _ts, batch, *_ = msgspec.msgpack.decode(payload)
        events += batch
    return events


def test_an_adopted_pool_announces_its_blocks_not_a_clear() -> None:
    d = DaemonProcess().start()
    try:
        store_two(d)
        d.kill(signal.SIGKILL)
        d.start()
        kinds = [e["type"] for e in replayed(d)]
        assert "BlockStored" in kinds and "AllBlocksCleared" not in kinds, kinds
    finally:
        d.stop()


def test_a_big_announcement_goes_out_in_slices_in_order_while_requests_are_served() -> None:
    """10,000 adopted blocks: announced exactly once each, a slice per loop turn
    (kvd.io.event_pump.PUBLISH_KEYS_PER_TURN), and an eviction after the restart is
    announced after the BlockStored of the block it evicts."""
    from kvd.io.event_pump import PUBLISH_KEYS_PER_TURN

    n, row = 10_000, 256
    layout = Layout("big", "int8", 16, 1, False, row)
    keys = [key(i) for i in range(n)]
    d = DaemonProcess(events_int_hashes="false", job_timeout_ms="500").start()
    try:
        with Scheduler("big", layout, engine_id="e", endpoint=d.endpoint,
                       capacity_bytes=n * row) as s:  # fmt: skip
            for first in range(0, n, 1000):
                out = s.prepare_store(keys[first : first + 1000])
                assert out is not None and len(out.keys_to_store) == 1000
                s.complete_store(keys[first : first + 1000])
        d.kill(signal.SIGKILL)
        d.start()
        with Scheduler("big", layout, engine_id="e2", endpoint=d.endpoint) as s:
            assert s.lookup(keys[:3]) == 3
            fresh = [key(n + 1)]
            deadline = time.monotonic() + 10
            while (out := s.prepare_store(fresh)) is None:  # held two job timeouts
                assert time.monotonic() < deadline, "stores still held 10 s after the restart"
                time.sleep(0.1)
            # full: evicts one adopted block
            assert out is not None and len(out.evicted_keys) == 1
            s.complete_store(fresh)
            evicted = out.evicted_keys[0]
        deadline = time.monotonic() + 20
        while True:
            events = replayed(d)
            stored = [bytes(h) for e in events if e["type"] == "BlockStored"
                      for h in e["block_hashes"]]  # fmt: skip
            if len(stored) >= n + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(stored) == sorted([*keys, *fresh])  # each exactly once
        assert n > PUBLISH_KEYS_PER_TURN  # so the announcement takes several turns
        slices = [e for e in events if e["type"] == "BlockStored"]
        assert len(slices) >= -(-n // PUBLISH_KEYS_PER_TURN)
        assert all(len(e["block_hashes"]) <= PUBLISH_KEYS_PER_TURN for e in slices)
        removed_at = next(i for i, e in enumerate(events) if e["type"] == "BlockRemoved")
        stored_at = next(i for i, e in enumerate(events) if e["type"] == "BlockStored"
                         and evicted in map(bytes, e["block_hashes"]))  # fmt: skip
        assert stored_at < removed_at
    finally:
        d.stop()


def test_segments_keep_their_mode() -> None:
    d = DaemonProcess().start()
    try:
        shm = store_two(d)
        assert stat.S_IMODE(os.stat("/dev/shm" + shm).st_mode) == 0o600
    finally:
        d.stop()


def _adopt_as_another_user(name: str, manifest: str, conn: object) -> None:
    """In a child: as `nobody` when run as root, what a daemon of another uid finds."""
    from kvd.io.region import Manifest, SharedRegion
    from kvd_client.segment import BadSegment

    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    try:
        SharedRegion.adopt(name, None)
        answer = "adopted"
    except BadSegment as exc:
        answer = f"refused: {exc}"
    gone = Manifest(Path(manifest)).unlink_stale()
    conn.send((answer, gone))  # type: ignore[attr-defined]


def test_a_segment_this_uid_cannot_open_is_refused_and_left_not_a_crash() -> None:
    """Another user's segment (or one whose mode keeps this uid out): refused with
    its reason, and the stale-segment sweep leaves it instead of raising."""
    import multiprocessing as mp

    name = f"/kvd.other.{os.getpid()}"
    seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=4096)
    seg.close_fd()
    import tempfile

    where = Path(tempfile.mkdtemp(prefix="kvd-t"))  # reachable by `nobody`, unlike tmp_path
    os.chmod(where, 0o777)
    manifest = where / "segments"
    manifest.write_text(name + "\n")
    os.chmod(manifest, 0o666)
    try:
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_adopt_as_another_user, args=(name, str(manifest), child))
        proc.start()
        assert parent.poll(20), "the child did not answer"
        answer, gone = parent.recv()
        proc.join(10)
        assert proc.exitcode == 0
        assert answer.startswith("refused: cannot be opened"), answer
        assert gone == []
        assert Path("/dev/shm" + name).exists()  # left for its owner
    finally:
        posix_ipc.unlink_shared_memory(name)
        shutil.rmtree(where, ignore_errors=True)
