"""Runs in the test process: each finding of the failure-rules review as a regression test.

Against a real daemon, over raw DEALER sockets where a test must play a
worker exactly (which session answers, when), and with the real
`Scheduler` and `Worker` where the finding is about them. Each test failed
on the main before the fix (the closing note of the change says how it was
run there).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from kvd_client import Layout, Scheduler, Worker
from kvd_client import protocol as p
from kvd_tools.launcher import DaemonProcess

SLOT = 4096
TP2 = p.Layout("fr-model@1", "bfloat16", 16, 2, False, SLOT)
TP1 = p.Layout("fr-model@1", "bfloat16", 16, 1, False, SLOT)
CAPACITY = 64 * 2 * SLOT


class Peer:
    """One DEALER socket speaking the wire protocol, one request at a time."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.pushed: list[p.TransferJob] = []
        self._rid = 0

    def ask(self, msg_type: type[p.Request], *args: object) -> p.Reply:
        self._rid += 1
        self.sock.send(p.encoder.encode(msg_type(self._rid, *args)))  # type: ignore[call-arg]
        while True:
            assert self.sock.poll(5000), f"no reply to {msg_type.__name__}"
            reply = p.reply_decoder.decode(self.sock.recv())
            if isinstance(reply, p.TransferJob):
                self.pushed.append(reply)
                continue
            assert reply.req_id == self._rid, reply
            return reply

    def receive_job(self, timeout_ms: int = 3000) -> p.TransferJob:
        while not self.pushed:
            assert self.sock.poll(timeout_ms), "no TransferJob arrived"
            msg = p.reply_decoder.decode(self.sock.recv())
            assert isinstance(msg, p.TransferJob), msg
            self.pushed.append(msg)
        return self.pushed.pop(0)

    def close(self) -> None:
        self.sock.close(linger=0)


class Wire:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.peers: list[Peer] = []
        self._admin: Peer | None = None

    def peer(
        self, role: p.Role, engine: str = "", rank: int = 0, world: int = 1, instance: str = ""
    ) -> Peer:
        peer = Peer(self.ctx, self.daemon.endpoint)
        self.peers.append(peer)
        reply = peer.ask(p.Hello, p.PROTOCOL_VERSION, role, engine, rank, world, 4242, instance)
        assert isinstance(reply, p.Welcome), reply
        return peer

    def attached(
        self, role: p.Role, pool: str, layout: p.Layout, engine: str, rank: int = 0, **kw: str
    ) -> Peer:
        peer = self.peer(role, engine, rank, layout.world_size, **kw)
        cap = CAPACITY if role == "scheduler" else None
        assert isinstance(peer.ask(p.Attach, pool, layout, cap), p.Attached)
        return peer

    def admin(self) -> Peer:
        """One admin session (every request renews its lease)."""
        if self._admin is None:
            self._admin = self.peer("admin")
        return self._admin

    def stats(self) -> p.StatsResult:
        reply = self.admin().ask(p.Stats)
        assert isinstance(reply, p.StatsResult)
        return reply

    def pool(self, name: str) -> p.PoolInfo:
        reply = self.admin().ask(p.Pools)
        assert isinstance(reply, p.PoolsResult)
        return next(pi for pi in reply.pools if pi.name == name)

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


@pytest.fixture
def wire(daemon: DaemonProcess) -> Iterator[Wire]:
    w = Wire(daemon)
    try:
        yield w
    finally:
        w.close()


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def results(sched: Peer) -> list[p.JobResult]:
    reply = sched.ask(p.Finished)
    assert isinstance(reply, p.FinishedResult)
    return reply.results


def store(sched: Peer, keys: list[bytes]) -> int:
    ticket = sched.ask(p.Store, keys, list(range(len(keys))))
    assert isinstance(ticket, p.StoreTicket) and ticket.fits and ticket.job_id is not None
    return ticket.job_id


def done(worker: Peer, job: p.TransferJob, rank: int, ok: bool = True) -> p.Reply:
    return worker.ask(p.JobDone, job.job_id, rank, ok, 0, 0.0, "")


# -- 1: jobs are matched to the session they were pushed to ------------------------


def test_a_worker_leaving_another_pool_leaves_this_pools_jobs_alone(wire: Wire) -> None:
    sched = wire.attached("scheduler", "fr-a", TP1, "E")
    real = wire.attached("worker", "fr-a", TP1, "E")
    elsewhere = wire.attached("worker", "fr-b", TP1, "E")  # same engine and rank, pool B
    job_id = store(sched, [key(1)])
    job = real.receive_job()
    assert elsewhere.ask(p.Goodbye) == p.Ok(elsewhere._rid)
    assert results(sched) == []  # nothing failed
    assert done(real, job, 0) == p.Ok(real._rid)
    (result,) = results(sched)
    assert result.job_id == job_id and result.ok
    assert sched.ask(p.Lookup, [key(1)]) == p.LookupResult(sched._rid, 1)


def test_an_ack_from_a_session_the_job_was_not_sent_to_is_refused(wire: Wire) -> None:
    sched = wire.attached("scheduler", "fr-t", TP2, "E")
    rank0 = wire.attached("worker", "fr-t", TP2, "E", 0)
    wire.attached("worker", "fr-t", TP2, "E", 1)  # rank 1 gets the job, and never copies
    impostor = wire.peer("worker", "E", 1, 2)  # same engine and rank, never attached
    store(sched, [key(2)])
    job = rank0.receive_job()
    reply = done(impostor, job, 1)
    assert isinstance(reply, p.Error) and reply.code == "NOT_OWNER"
    assert done(rank0, job, 0) == p.Ok(rank0._rid)
    # Rank 1 has not copied: the block must not be loadable.
    assert sched.ask(p.Lookup, [key(2)]) == p.LookupResult(sched._rid, None)


# -- 2: a reconnect does not settle jobs that are still being copied -----------------


def test_a_reconnecting_worker_process_keeps_its_jobs(wire: Wire) -> None:
    sched = wire.attached("scheduler", "fr-r", TP1, "E")
    first = wire.attached("worker", "fr-r", TP1, "E", instance="proc-1")
    job_id = store(sched, [key(3)])
    job = first.receive_job()
    # The keeper thread of the same process reconnects while the copy runs.
    again = wire.attached("worker", "fr-r", TP1, "E", instance="proc-1")
    assert again.receive_job() == job  # pushed again: the first push may have been lost
    assert results(sched) == []
    info = wire.pool("fr-r")
    assert info.blocks_in_flight == 1  # its slot was not freed under the copy
    assert done(again, job, 0) == p.Ok(again._rid)
    (result,) = results(sched)
    assert result.job_id == job_id and result.ok
    assert sched.ask(p.Lookup, [key(3)]) == p.LookupResult(sched._rid, 1)


def test_another_process_on_the_rank_fails_the_job_but_holds_its_slots(
    wire: Wire, daemon: DaemonProcess
) -> None:
    sched = wire.attached("scheduler", "fr-o", TP1, "E")
    first = wire.attached("worker", "fr-o", TP1, "E", instance="proc-1")
    store(sched, [key(4)])
    first.receive_job()
    wire.attached("worker", "fr-o", TP1, "E", instance="proc-2")  # a new process
    (result,) = results(sched)
    assert not result.ok and "went away" in result.detail
    # proc-1 may still be copying: the slot stays held one more lease.
    t0 = time.monotonic()
    assert wire.pool("fr-o").blocks_in_flight == 1
    assert sched.ask(p.Lookup, [key(4)]) == p.LookupResult(sched._rid, None)
    job_deadline = int(daemon.flags["job-timeout-ms"]) / 1000  # it may still start it
    while wire.pool("fr-o").blocks_in_flight and time.monotonic() - t0 < job_deadline + 2:
        sched.ask(p.Heartbeat)
        time.sleep(0.02)
    assert time.monotonic() - t0 >= 0.5 * daemon.lease_s
    assert wire.pool("fr-o").blocks_in_flight == 0
    assert sched.ask(p.Lookup, [key(4)]) == p.LookupResult(sched._rid, 0)


# -- 3 and 4: a timeout is not "not done"; a worker runs only named jobs ------------


def _caches() -> torch.Tensor:
    return torch.arange(8 * SLOT, dtype=torch.uint8).reshape(8, SLOT) % 251


def test_a_store_that_timed_out_is_never_copied(daemon: DaemonProcess, wire: Wire) -> None:
    layout = Layout("fr-timeout@1", "bfloat16", 16, 1, False, SLOT)
    kv = _caches()
    with (
        Scheduler("fr-x", layout, engine_id="E", endpoint=daemon.endpoint, timeout_ms=300,
                  capacity_bytes=CAPACITY) as s,
        Worker(0, 1, kv, pool="fr-x", layout=layout, engine_id="E",
               endpoint=daemon.endpoint) as w,
    ):  # fmt: skip
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            ticket = s.store([key(5)], [0])  # the daemon takes it, but answers too late
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert ticket is None
        kv.zero_()  # the engine reuses its device blocks: nothing was stored
        hits = set()
        probe = wire.attached("scheduler", "fr-x", layout, "probe")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2 * int(daemon.flags["job-timeout-ms"]) / 1000 + 2:
            w.poll(50)  # the engine names no job: it never learnt of one
            reply = probe.ask(p.Lookup, [key(5)])
            assert isinstance(reply, p.LookupResult)
            hits.add(reply.hits)
            stats = wire.stats()
            if stats.counters.get("jobs_failed.store") and not wire.pool("fr-x").blocks_in_flight:
                break
        assert stats.counters["stores"] == 1  # the daemon did take the store
        assert stats.counters["jobs_failed.store"] == 1
        assert w.bytes_copied == 0
        assert 1 not in hits  # never a poisoned hit
        assert wire.pool("fr-x").blocks_in_flight == 0


def test_a_worker_never_starts_a_job_past_its_deadline() -> None:
    with DaemonProcess(job_timeout_ms="400") as d:
        layout = Layout("fr-deadline@1", "bfloat16", 16, 1, False, SLOT)
        with (
            Scheduler("fr-d", layout, engine_id="E", endpoint=d.endpoint,
                      capacity_bytes=CAPACITY) as s,
            Worker(0, 1, _caches(), pool="fr-d", layout=layout, engine_id="E",
                   endpoint=d.endpoint) as w,
        ):  # fmt: skip
            ticket = s.store([key(6)], [0])
            assert ticket is not None and ticket.job_id is not None
            w.poll(100)  # arrives, but the engine has not named it: not started
            assert w.bytes_copied == 0
            time.sleep(0.5)  # its deadline passes
            assert w.wait([ticket.job_id], timeout_s=5) == {ticket.job_id: False}
            assert w.bytes_copied == 0
            assert s.lookup([key(6)]) == 0


# -- 5: reset needs authority and waits for the copies ------------------------------


def test_reset_and_invariants_need_authority(wire: Wire, daemon: DaemonProcess) -> None:
    wire.attached("scheduler", "fr-v", TP1, "E")
    stranger = wire.attached("scheduler", "fr-w", TP1, "F")
    for reply in (
        stranger.ask(p.Reset, "fr-v"),
        wire.peer("admin").ask(p.Reset, "fr-v"),
        stranger.ask(p.CheckInvariants),
    ):
        assert isinstance(reply, p.Error) and reply.code == "WRONG_ROLE", reply
    admin = wire.admin()
    assert admin.ask(p.Reset, "fr-v", daemon.admin_token) == p.Ok(admin._rid)
    inv = admin.ask(p.CheckInvariants, daemon.admin_token)
    assert isinstance(inv, p.InvariantsResult) and inv.problems == []


def test_reset_waits_for_jobs_in_flight_before_slots_are_reused(wire: Wire) -> None:
    sched = wire.attached("scheduler", "fr-z", TP1, "E")
    worker = wire.attached("worker", "fr-z", TP1, "E")
    for i in range(3):
        sched.ask(p.PrepareStore, [key(100 + i)])
        sched.ask(p.CompleteStore, [key(100 + i)], True)
    store(sched, [key(7)])
    job = worker.receive_job()
    assert sched.ask(p.Reset, "fr-z") == p.Ok(sched._rid)
    (result,) = results(sched)
    assert not result.ok and "reset" in result.detail
    # Until the copy is over: no hits, no new transfers, the slot still held.
    assert sched.ask(p.Lookup, [key(100)]) == p.LookupResult(sched._rid, 0)
    assert sched.ask(p.Store, [key(8)], [1]) == p.StoreTicket(sched._rid, False)
    assert wire.pool("fr-z").blocks_in_flight == 1
    assert done(worker, job, 0) == p.Ok(worker._rid)
    info = wire.pool("fr-z")
    assert (info.blocks_ready, info.blocks_in_flight, info.blocks_free) == (0, 0, info.num_blocks)
    assert isinstance(sched.ask(p.PrepareStore, [key(8)]), p.PrepareStoreResult)


# -- 6: hostile numbers are refused; a dead loop task stops the daemon ---------------


def test_hostile_job_done_is_refused_and_the_daemon_keeps_expiring_leases(
    wire: Wire, daemon: DaemonProcess
) -> None:
    sched = wire.attached("scheduler", "fr-h", TP1, "E")
    worker = wire.attached("worker", "fr-h", TP1, "E")
    store(sched, [key(9)])
    job = worker.receive_job()
    for args in (
        (job.job_id, 0, True, (1 << 63) - 1, 0.0, ""),
        (job.job_id, 0, True, -1, 0.0, ""),
        (job.job_id, 0, True, 0, float("inf"), ""),
        (job.job_id, 0, True, 0, 0.0, "x" * 100_000),
        (job.job_id, -5, True, 0, 0.0, ""),
    ):
        reply = worker.ask(p.JobDone, *args)
        assert isinstance(reply, p.Error) and reply.code == "BAD_REQUEST", args
    stats = wire.stats()
    # A session that goes silent is still rolled back: the ticker lives.
    silent = wire.attached("scheduler", "fr-h", TP1, "S")
    silent.ask(p.PrepareStore, [key(10)])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4 * daemon.lease_s + 2:
        after = wire.stats()
        if after.lease_expirations > stats.lease_expirations:
            break
        sched.ask(p.Heartbeat)
        worker.ask(p.Heartbeat)
        time.sleep(0.1)
    assert after.lease_expirations > stats.lease_expirations
    assert daemon.proc is not None and daemon.proc.poll() is None


# -- 7: prefaulting a pool does not stall the loop ----------------------------------


def test_requests_are_answered_while_a_new_pool_is_prefaulted() -> None:
    size = 2 << 30
    with DaemonProcess(max_total_bytes="3GiB", prefault="true") as d:
        w = Wire(d)
        try:
            big = w.peer("scheduler", "E")
            other = w.peer("scheduler", "F")
            t0 = time.monotonic()
            big._rid += 1
            big.sock.send(p.encoder.encode(p.Attach(big._rid, "fr-big", TP1, size)))
            other._rid += 1
            other.sock.send(p.encoder.encode(p.Heartbeat(other._rid)))
            assert other.sock.poll(30_000)
            latency = time.monotonic() - t0
            assert p.reply_decoder.decode(other.sock.recv()) == p.Ok(other._rid)
            assert big.sock.poll(30_000)
            assert isinstance(p.reply_decoder.decode(big.sock.recv()), p.Attached)
            while "event=prefaulted" not in d.log() and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            (line,) = [x for x in d.log().splitlines() if "event=prefaulted" in x]
            prefault_s = float(line.rsplit("seconds=", 1)[1].split()[0])
            # Both answers came while the pages were still being allocated.
            assert latency < prefault_s / 2, (latency, prefault_s)
        finally:
            w.close()


# -- 8: what a client leaves behind is bounded ---------------------------------------


def test_results_never_collected_are_bounded_and_counted() -> None:
    with DaemonProcess(max_pending_results="8") as d:
        w = Wire(d)
        try:
            sched = w.attached("scheduler", "fr-m", TP1, "E")
            worker = w.attached("worker", "fr-m", TP1, "E")
            for i in range(20):
                store(sched, [key(200 + i)])
                assert done(worker, worker.receive_job(), 0) == p.Ok(worker._rid)
            got = results(sched)
            assert w.stats().counters["results_dropped"] == 20 - len(got)
            assert 0 < len(got) <= 8
            assert [r.job_id for r in got] == sorted(r.job_id for r in got)  # the newest
        finally:
            w.close()


# -- 9: a rolled-back store's slots are quarantined past the lease ------------------


def test_a_lease_expiry_holds_prepared_slots_one_more_lease(
    wire: Wire, daemon: DaemonProcess
) -> None:
    sched = wire.attached("scheduler", "fr-q", TP1, "E")
    reply = sched.ask(p.PrepareStore, [key(11), key(12)])
    assert isinstance(reply, p.PrepareStoreResult) and reply.fits
    base = wire.stats()
    lease = daemon.lease_s
    t0 = time.monotonic()
    expired_at = None
    while time.monotonic() - t0 < 4 * lease:
        stats = wire.stats()
        in_flight = wire.pool("fr-q").blocks_in_flight
        if expired_at is None and stats.lease_expirations > base.lease_expirations:
            expired_at = time.monotonic()
            # The engine's own transfer channel may still write: the slots stay held.
            assert in_flight == 2
        if expired_at is not None and in_flight == 0:
            break
        time.sleep(0.02)
    assert expired_at is not None and in_flight == 0
    assert time.monotonic() - expired_at >= 0.8 * lease  # held for about a lease


# -- 10: a pin count cannot overflow ------------------------------------------------


def test_pins_on_one_key_cannot_overflow() -> None:
    from kvd.core.index import BlockIndex

    ix = BlockIndex(4)
    out = ix.prepare_store([b"k"])
    assert out is not None
    ix.complete_store([b"k"])
    (slot,) = out.store_spec.slots
    ix.prepare_load([b"k"])
    ix._refs[slot] = (1 << 31) - 1  # as after 2^31 - 1 loads (no test can make so many)
    ix.prepare_load([b"k"])
    assert ix._refs[slot] == 1 << 31
    assert ix.check_invariants() == []


def test_a_store_whose_push_fails_gives_its_slots_back(tmp_path: object) -> None:
    """The real `Service` in process (no sockets): a push that raises rolls back."""
    from pathlib import Path

    from kvd.config import load_config
    from kvd.control.pools import PoolRegistry
    from kvd.control.service import Service
    from kvd.io.region import Manifest

    assert isinstance(tmp_path, Path)
    config = load_config(None, {"runtime_dir": str(tmp_path), "prefault": False})
    pools = PoolRegistry(config, Manifest(tmp_path / "segments"), None)
    service = Service(config, pools, "token")
    try:
        for ident, role in ((b"s", "scheduler"), (b"w", "worker")):
            service.handle(ident, p.encoder.encode(p.Hello(1, p.PROTOCOL_VERSION, role, "E")), 0.0)  # type: ignore[arg-type]
            cap = CAPACITY if role == "scheduler" else None
            service.handle(ident, p.encoder.encode(p.Attach(2, "fr-p", TP1, cap)), 0.0)
        service.outbox.clear()

        def refuse(msg: object) -> bytes:
            if isinstance(msg, p.TransferJob):
                raise RuntimeError("cannot encode the push")
            return p.encoder.encode(msg)

        service.transfers._encode = refuse
        service.handle(b"s", p.encoder.encode(p.Store(3, [key(1)], [0])), 0.0)
        ((ident, frame),) = service.outbox
        reply = p.reply_decoder.decode(frame)
        assert isinstance(reply, p.Error) and reply.code == "INTERNAL"
        info = pools.get("fr-p").info()
        assert (info.blocks_in_flight, info.blocks_free) == (0, info.num_blocks)
        assert len(service.transfers) == 0
        # A load whose push fails gives its pins back the same way.
        service.transfers._encode = p.encoder.encode
        service.handle(b"s", p.encoder.encode(p.PrepareStore(4, [key(2)])), 0.0)
        service.handle(b"s", p.encoder.encode(p.CompleteStore(5, [key(2)], True)), 0.0)
        service.outbox.clear()
        service.transfers._encode = refuse
        service.handle(b"s", p.encoder.encode(p.Load(6, [key(2)], [0])), 0.0)
        ((ident, frame),) = service.outbox
        reply = p.reply_decoder.decode(frame)
        assert isinstance(reply, p.Error) and reply.code == "INTERNAL"
        assert pools.get("fr-p").info().blocks_pinned == 0
    finally:
        pools.close()


# -- what the review of the fixes found -------------------------------------------


def test_job_ids_do_not_repeat_across_a_daemon_restart(daemon: DaemonProcess) -> None:
    w = Wire(daemon)
    try:
        sched = w.attached("scheduler", "fr-id", TP1, "E")
        w.attached("worker", "fr-id", TP1, "E")
        first = store(sched, [key(1)])
    finally:
        w.close()
    daemon.kill()
    daemon.start()
    w = Wire(daemon)
    try:
        sched = w.attached("scheduler", "fr-id", TP1, "E")
        worker = w.attached("worker", "fr-id", TP1, "E")
        deadline = time.monotonic() + 15  # an adopted pool holds stores two job timeouts
        while not getattr(ticket := sched.ask(p.Store, [key(2)], [0]), "fits", False):
            assert isinstance(ticket, p.StoreTicket), ticket
            assert time.monotonic() < deadline, "stores still held 15 s after the restart"
            assert isinstance(worker.ask(p.Heartbeat), p.Ok)  # the test's lease is short
            time.sleep(0.1)
        assert isinstance(ticket, p.StoreTicket) and ticket.job_id is not None
        assert ticket.job_id > first  # a worker may still remember `first`
    finally:
        w.close()


def test_a_job_the_engine_stopped_waiting_for_is_never_run(daemon: DaemonProcess) -> None:
    layout = Layout("fr-abandon@1", "bfloat16", 16, 1, False, SLOT)
    kv = _caches()
    with (
        Scheduler("fr-ab", layout, engine_id="E", endpoint=daemon.endpoint,
                  capacity_bytes=CAPACITY) as s,
        Worker(0, 1, kv, pool="fr-ab", layout=layout, engine_id="E",
               endpoint=daemon.endpoint) as w,
    ):  # fmt: skip
        ticket = s.store([key(7)], [0])
        assert ticket is not None and ticket.job_id is not None
        # The push is still in the worker's socket: the engine gives up at once.
        assert w.wait([ticket.job_id], timeout_s=0) == {ticket.job_id: False}
        kv.zero_()  # and reuses its device blocks
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2:
            w.poll(50)  # the job arrives now, and is refused
        assert w.bytes_copied == 0
        assert s.lookup([key(7)]) == 0
        failed = [r for r in s.finished() if r.job_id == ticket.job_id]
        assert failed and not failed[0].ok


def test_a_worker_back_after_its_lease_ran_out_takes_its_jobs_over(
    wire: Wire, daemon: DaemonProcess
) -> None:
    sched = wire.attached("scheduler", "fr-back", TP1, "E")
    first = wire.attached("worker", "fr-back", TP1, "E", instance="proc-1")
    job_id = store(sched, [key(8)])
    job = first.receive_job()
    base = wire.stats().lease_expirations
    t0 = time.monotonic()
    while wire.stats().lease_expirations == base:  # the worker stalls past its lease
        assert time.monotonic() - t0 < 3 * daemon.lease_s
        sched.ask(p.Heartbeat)
        time.sleep(0.05)
    back = wire.attached("worker", "fr-back", TP1, "E", instance="proc-1")
    assert back.receive_job() == job  # pushed again to the process's new session
    assert done(back, job, 0) == p.Ok(back._rid)
    (result,) = [r for r in results(sched) if r.job_id == job_id]
    assert not result.ok  # it failed when the lease ran out ...
    assert sched.ask(p.Lookup, [key(8)]) == p.LookupResult(sched._rid, 0)
    assert wire.pool("fr-back").blocks_in_flight == 0  # ... and settled at its answer


def test_an_answer_lost_while_the_daemon_stalls_is_sent_again(daemon: DaemonProcess) -> None:
    layout = Layout("fr-resend@1", "bfloat16", 16, 1, False, SLOT)
    with (
        Scheduler("fr-rs", layout, engine_id="E", endpoint=daemon.endpoint,
                  capacity_bytes=CAPACITY, timeout_ms=10_000) as s,
        Worker(0, 1, _caches(), pool="fr-rs", layout=layout, engine_id="E",
               endpoint=daemon.endpoint, timeout_ms=300) as w,
    ):  # fmt: skip
        ticket = s.store([key(9)], [0])
        assert ticket is not None and ticket.job_id is not None
        w.poll(200)  # the push is in
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            w.start([ticket.job_id])  # copies
            w.poll(0)  # and acknowledges: its JobDone times out
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert w.bytes_copied > 0
        t0 = time.monotonic()
        while s.lookup([key(9)]) != 1:  # the reconnect sends the answer again
            assert time.monotonic() - t0 < 10, "the answer was never sent again"
            w.poll(50)
        ok = [r for r in s.finished() if r.job_id == ticket.job_id]
        assert ok and ok[0].ok


DEAD_TICKER = """
import sys
from kvd.config import load_config
from kvd.control.service import Service
from kvd.io import server
from kvd.logs import setup_logging

def boom(self, now):
    raise RuntimeError("the ticker dies")

Service.tick = boom
config = load_config(None, {"runtime_dir": sys.argv[1], "metrics_addr": "none", "lease_ms": 200})
setup_logging("info")
sys.exit(server.run(config))
"""


def test_a_dead_loop_task_stops_the_daemon_with_exit_1(tmp_path: object) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", DEAD_TICKER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "event=loop_task_died task=ticker" in out.stderr
    assert "event=shutdown_complete" in out.stderr  # a clean shutdown, not a crash
