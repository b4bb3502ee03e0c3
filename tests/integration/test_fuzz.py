"""Runs in the test process: a Hypothesis fuzzer over every request type of the control channel.

Each input is one frame from one of nine peers, raw ZeroMQ DEALER sockets:

    fresh     never says Hello: every well-formed request is NOT_HELLO
    hello     Hello with hostile versions, roles, ranks, engine ids, pids and instances
    admin     an admin attached nowhere: pool verbs NOT_ATTACHED, JobDone WRONG_ROLE
    sched     scheduler of engine "fz" on pool "fz"; the fz worker copies its jobs
    lonely    scheduler of engine "lonely" on pool "fz", no worker: WORKERS_MISSING
    worker    rank 0 of engine "fz" on pool "fz": pool verbs WRONG_ROLE. Played by
    rejoin      one of these two: the other takes the rank over, as a reconnect of
              the same process (it keeps the jobs, pushed again), as another process
              (the jobs fail, their slots held a lease), or as the process it played
              before, back for the jobs it left
    attacher  a scheduler attached nowhere: Attach with hostile names, layouts, capacities
    impostor  rank 0 of engine "fz" too, never attached: its acks are NOT_OWNER

Frames are real Structs with hostile values (negative and huge numbers on
both sides of every schema bound, empty and 100,000-key lists, 1 MB keys and
strings, unknown pools, near misses of the operator token), hand-built
msgpack outside the schema, random bytes, mutated and truncated frames,
multipart messages, and frames over MAX_FRAME_BYTES (on throwaway sockets:
dropped, no reply). Some inputs are resolved when sent: a JobDone for a job
live then (hostile numbers and strings; from its worker, the impostor,
non-workers), a Load, Lookup (pinning or not), PrepareLoad or Touch of keys ready then, the
completion of what a scheduler holds, and a worker reconnect, with or
without the same instance, while a store is being copied. Resets and drops
come from sessions with and without authority, CheckInvariants with and
without the token. The fake worker acknowledges a job at once (ok or
failed, with edge values) or leaves it live, so resets, drops, session ends,
reconnects and acks meet jobs in flight.

The expected answer is computed by a model: the frame decoded with the shared
schema (a violation is BAD_REQUEST echoing the req_id when the envelope holds
a valid one, else 0), then the session, role, pool, reset and job rules of
SPEC sections 3 to 7 and 11 over the pure core the daemon runs (`OwnedIndex`
over `BlockIndex`). Normal replies and pushed jobs must equal the model's
field for field; errors must carry the model's code. CheckInvariants runs
every 500 inputs and at the end; the daemon must stay up, and its tick must
still finish a reset. KVD_FUZZ_EXAMPLES inputs (100,000 in the long run).

The model has no clock, so that run leases nothing for less than an hour.
`test_leases_expire_after_hostile_traffic` sends the same kind of inputs,
unchecked, to a daemon with one-second leases and job timeouts, then goes
silent: every lease must expire and every job and held slot settle.
"""

from __future__ import annotations

import os
import time
import typing
from collections.abc import Callable

import msgspec
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvd_client import protocol as p
from kvd_tools.launcher import DaemonProcess
from tests.integration.fuzz_model import FLAGS, FZ, FZ_CAPACITY, HOMES, Fuzz, Input, ready_request
from tests.integration.fuzz_strategies import ADMIN_TOKEN, KNOWN, inputs

NUM_INPUTS = int(os.environ.get("KVD_FUZZ_EXAMPLES", "10000"))
BATCH = 8
SHORT = {**FLAGS, "lease-ms": "1000", "job-timeout-ms": "1000"}


def run_inputs(num_inputs: int, count: Callable[[], int], feed: Callable[[Input], None]) -> None:
    """Feeds Hypothesis-drawn batches of inputs until `count()` reaches `num_inputs`."""

    def run_examples(num_examples: int) -> None:
        @settings(
            max_examples=num_examples,
            # Same inputs on every run (CI included) unless asked otherwise,
            # so the coverage assertions below cannot flake.
            derandomize=os.environ.get("KVD_FUZZ_RANDOM") is None,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.lists(inputs, min_size=BATCH, max_size=BATCH))
        def run(batch: list[Input]) -> None:
            for inp in batch:
                feed(inp)

        run()

    # Hypothesis may stop a run short (examples it discards); top it up.
    for _ in range(5):
        if count() >= num_inputs:
            break
        run_examples(max(1, -(-(num_inputs - count()) // BATCH)))


class Wire:
    """Plain request and reply on fresh sockets, for the checks after a run."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.endpoint = daemon.endpoint
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.socks: list[zmq.Socket[bytes]] = []

    def peer(self, role: p.Role, engine: str = "") -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self.socks.append(sock)
        assert isinstance(self.ask(sock, p.Hello(1, p.PROTOCOL_VERSION, role, engine)), p.Welcome)
        return sock

    @staticmethod
    def ask(sock: zmq.Socket[bytes], msg: p.Request) -> p.Reply:
        sock.send(p.encoder.encode(msg))
        while True:
            assert sock.poll(10_000), f"no reply to {msg!r}"
            reply = p.reply_decoder.decode(sock.recv())
            if not isinstance(reply, p.TransferJob):
                assert reply.req_id == msg.req_id, (msg, reply)
                return reply

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def check_the_tick_finishes_a_reset(daemon: DaemonProcess) -> None:
    """A reset that waits for a pin is finished by the daemon's tick once the pin
    goes (no request retries it): the loop still runs after the fuzzing."""
    wire = Wire(daemon)
    try:
        admin, sched = wire.peer("admin"), wire.peer("scheduler", "tick")
        pools = wire.ask(admin, p.Pools(1))
        assert isinstance(pools, p.PoolsResult)
        for info in pools.pools:  # room for one more pool, whatever the run left
            assert wire.ask(admin, p.DropPool(2, info.name, daemon.admin_token)) == p.Ok(2)
        assert isinstance(wire.ask(sched, p.Attach(2, "fz-tick", FZ, FZ_CAPACITY)), p.Attached)
        assert isinstance(wire.ask(sched, p.PrepareStore(3, [b"t"])), p.PrepareStoreResult)
        assert wire.ask(sched, p.CompleteStore(4, [b"t"], True)) == p.Ok(4)
        assert isinstance(wire.ask(sched, p.PrepareLoad(5, [b"t"])), p.SlotsResult)
        assert wire.ask(sched, p.Reset(6, "fz-tick")) == p.Ok(6)
        assert wire.ask(sched, p.Lookup(7, [b"t"])) == p.LookupResult(7, 0)  # resetting
        assert wire.ask(sched, p.CompleteLoad(8, [b"t"])) == p.Ok(8)
        deadline = time.monotonic() + 5
        while True:
            pools = wire.ask(admin, p.Pools(3))
            assert isinstance(pools, p.PoolsResult)
            (info,) = pools.pools
            if info.blocks_ready == 0:
                break
            assert time.monotonic() < deadline, f"the reset never finished: {info}"
            time.sleep(0.05)
        reply = wire.ask(sched, p.PrepareStore(9, [b"t"]))
        assert isinstance(reply, p.PrepareStoreResult) and reply.fits  # no longer resetting
    finally:
        wire.close()


def test_fuzz_every_request_type() -> None:
    daemon = DaemonProcess(base=FLAGS).start()
    fuzz = Fuzz(daemon)
    ADMIN_TOKEN[0] = fuzz.model.admin_token = daemon.admin_token
    try:
        fuzz.home()
        fuzz.count_outside_sessions()
        start = time.monotonic()
        run_inputs(NUM_INPUTS, lambda: fuzz.count, fuzz.feed)
        fuzz.checkpoint()
        every = set(typing.get_args(p.Request))
        print(f"\nfuzz: {fuzz.count} inputs in {time.monotonic() - start:.0f} s")
        print(f"fuzz: error codes {dict(sorted(fuzz.codes.items()))}")
        print(f"fuzz: model events {dict(sorted(fuzz.model.events.items()))}")
        assert fuzz.count >= NUM_INPUTS
        if NUM_INPUTS >= 2000:
            assert fuzz.seen == every, f"never sent: {every - fuzz.seen}"
        if NUM_INPUTS >= 10_000:  # these come at least a few times per thousand inputs
            wanted = {"BAD_REQUEST", "NOT_HELLO", "NOT_ATTACHED", "WRONG_ROLE", "NOT_OWNER",
                      "MISSING", "NO_SUCH_POOL", "WORKERS_MISSING", "LAYOUT_MISMATCH",
                      "UNSUPPORTED_VERSION"}  # fmt: skip
            assert wanted <= set(fuzz.codes), f"never answered: {wanted - set(fuzz.codes)}"
            events = {"jobs left live", "jobs inherited", "jobs held for a lease",
                      "jobs acked", "resets done", "verbs while resetting", "pools dropped",
                      "workers replaced", "resets retried"}  # fmt: skip
            assert events <= set(fuzz.model.events), f"never: {events - set(fuzz.model.events)}"
        assert daemon.proc is not None and daemon.proc.poll() is None
        check_the_tick_finishes_a_reset(daemon)
    finally:
        fuzz.close()
        daemon.stop()


class Unchecked:
    """The fuzzer's peers and inputs without the model: every request must get one
    reply a client can decode, whatever the daemon's clock did meanwhile."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        names = ["fresh", "hello", "rejoin", *HOMES]
        self.socks = {name: self._socket() for name in names}
        self.jobs: list[tuple[str, int]] = []  # (peer, job id) pushed, not yet answered
        self.count = 0
        self.rid = 1 << 40

    def _socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.daemon.endpoint)
        return sock

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()

    def send(self, name: str, frame: bytes | tuple[bytes, ...]) -> p.Reply:
        sock = self.socks[name]
        if isinstance(frame, tuple):
            sock.send_multipart(list(frame))
        else:
            sock.send(frame)
        while True:
            alive = self.daemon.proc is not None and self.daemon.proc.poll() is None
            assert sock.poll(20_000), f"no reply to {name} in 20 s (daemon alive: {alive})"
            reply = p.reply_decoder.decode(sock.recv())  # every reply must decode
            if not isinstance(reply, p.TransferJob):
                assert not isinstance(reply, p.Error) or reply.detail, reply
                return reply
            self.jobs.append((name, reply.job_id))

    def ask(self, name: str, msg: p.Request) -> p.Reply:
        return self.send(name, p.encoder.encode(msg))

    def next_rid(self) -> int:
        self.rid += 1
        return self.rid

    def home(self) -> None:
        for name, (role, engine, pool) in HOMES.items():
            rid = self.next_rid()
            self.ask(name, p.Hello(rid, p.PROTOCOL_VERSION, role, engine, 0, 1, 1, name))
            if pool is not None:
                self.ask(name, p.Attach(self.next_rid(), pool, FZ, FZ_CAPACITY))

    def feed(self, inp: Input) -> None:
        self.count += 1
        if self.count % 50 == 1:  # sessions expire at the daemon's pace: open them again
            self.home()
        if inp.oversized:
            return
        for name, sock in self.socks.items():  # jobs pushed since
            while sock.poll(0):
                msg = p.reply_decoder.decode(sock.recv())
                assert isinstance(msg, p.TransferJob), f"{name} got {msg!r} unasked"
                self.jobs.append((name, msg.job_id))
        if inp.rejoin is not None:
            how, _ = inp.rejoin
            instance = {"same": "worker", "back": "worker", "none": ""}.get(how, f"p{self.count}")
            hello = p.Hello(self.next_rid(), p.PROTOCOL_VERSION, "worker", "fz", 0, 1, 7, instance)
            self.ask("rejoin", hello)
            self.ask("rejoin", p.Attach(self.next_rid(), "fz", FZ, None))
        elif inp.live is not None:
            pick, msg = inp.live
            job_id = self.jobs[pick % len(self.jobs)][1] if self.jobs else pick
            self.ask(inp.peer, msgspec.structs.replace(msg, job_id=job_id))
        elif inp.ready is not None:
            verb, n, rid = inp.ready
            ks = KNOWN[:n]
            msg = ready_request(verb, rid, ks, list(range(n)))
            self.ask(inp.peer, msg)
        elif inp.complete is not None:
            rid, success = inp.complete
            self.ask(inp.peer, p.CompleteLoad(rid, KNOWN[:4]))
            self.ask(inp.peer, p.CompleteStore(rid, KNOWN[:4], success))
        else:
            self.send(inp.peer, inp.frame)
        if inp.ack != "later":
            for name, job_id in self.jobs:
                self.ask(name, p.JobDone(self.next_rid(), job_id, 0, inp.ack == "ok"))
            self.jobs.clear()


def test_leases_expire_after_hostile_traffic() -> None:
    daemon = DaemonProcess(base=SHORT).start()
    fuzz = Unchecked(daemon)
    ADMIN_TOKEN[0] = daemon.admin_token
    wire = Wire(daemon)
    try:
        fuzz.home()
        run_inputs(max(500, NUM_INPUTS // 10), lambda: fuzz.count, fuzz.feed)
        fuzz.close()  # every peer goes silent
        # Then every session's lease expires, every job passes its hard deadline
        # (two timeouts), every held slot its extra lease: the daemon settles all.
        admin = wire.peer("admin")
        deadline = time.monotonic() + 30
        while True:
            stats = wire.ask(admin, p.Stats(1))
            assert isinstance(stats, p.StatsResult)
            settled = stats.sessions == 1 and stats.jobs_in_flight == 0
            settled &= all(pi.blocks_in_flight == pi.blocks_pinned == 0 for pi in stats.pools)
            if settled and stats.lease_expirations > 0:
                break
            assert time.monotonic() < deadline, f"still held after 30 s of silence: {stats}"
            time.sleep(0.2)
        print(f"\nshort leases: {fuzz.count} inputs, {stats.lease_expirations} leases expired")
        # ... and a session that goes silent now still expires.
        wire.peer("scheduler", "late")
        before = stats.lease_expirations
        deadline = time.monotonic() + 10
        while True:
            stats = wire.ask(admin, p.Stats(2))
            assert isinstance(stats, p.StatsResult)
            if stats.lease_expirations > before and stats.sessions == 1:
                break
            assert time.monotonic() < deadline, f"a silent session did not expire: {stats}"
            time.sleep(0.2)
        inv = wire.ask(admin, p.CheckInvariants(3, daemon.admin_token))
        assert isinstance(inv, p.InvariantsResult) and inv.problems == []
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        fuzz.close()
        wire.close()
        daemon.stop()


def test_what_the_fuzzer_found() -> None:
    """Regressions, each once found by the fuzzer (kvd/control/service.py, kvd/core/ownership.py)."""
    daemon = DaemonProcess(base=FLAGS).start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socks: list[zmq.Socket[bytes]] = []

    def peer() -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.endpoint)
        socks.append(sock)
        return sock

    def ask(sock: zmq.Socket[bytes], frame: bytes | p.Request) -> p.Reply:
        sock.send(frame if isinstance(frame, bytes) else p.encoder.encode(frame))
        assert sock.poll(5000), "no reply"
        return p.reply_decoder.decode(sock.recv())  # every reply must decode

    def code(reply: p.Reply) -> str:
        return reply.code if isinstance(reply, p.Error) else type(reply).__name__

    try:
        a, w, admin = peer(), peer(), peer()
        # A frame nested 100,000 deep got no reply (RecursionError escaped the handler).
        assert code(ask(a, b"\x91" * 100_000 + b"\xc0")) == "BAD_REQUEST"
        # A bool req_id was echoed back as a bool: a reply no client could decode.
        reply = ask(a, msgspec.msgpack.encode(["Lookup", True, []]))
        assert isinstance(reply, p.Error) and reply.req_id == 0
        assert code(ask(a, p.Hello(1, p.PROTOCOL_VERSION, "scheduler", "e"))) == "Welcome"
        assert code(ask(w, p.Hello(1, p.PROTOCOL_VERSION, "worker", "e"))) == "Welcome"
        assert code(ask(admin, p.Hello(1, p.PROTOCOL_VERSION, "admin"))) == "Welcome"
        # Non-ASCII letters and digits made pool (and segment) names.
        assert code(ask(a, p.Attach(2, "ñame", FZ, 4096))) == "BAD_REQUEST"
        assert code(ask(a, p.Attach(3, "x", FZ, 4096))) == "Attached"
        assert code(ask(w, p.Attach(2, "x", FZ, None))) == "Attached"
        # An empty CompleteLoad from a session holding no pins was INTERNAL.
        assert ask(a, p.CompleteLoad(4, [])) == p.Ok(4)
        assert code(ask(admin, p.DropPool(2, "x", daemon.admin_token))) == "Ok"
        # An idle worker on a dropped pool heard nothing and kept getting jobs.
        assert code(ask(w, p.Heartbeat(3))) == "NO_SUCH_POOL"
        assert code(ask(a, p.Attach(5, "x", FZ, 4096))) == "Attached"  # re-created
        assert code(ask(a, p.Store(6, [b"k"], [0]))) == "WORKERS_MISSING"
        assert not w.poll(200), "a job went to a worker of the dropped pool"
        # Re-attaching to the re-created pool did not count the session (0, then -1).
        pools = ask(admin, p.Pools(3))
        assert isinstance(pools, p.PoolsResult) and [pi.sessions for pi in pools.pools] == [1]
        assert ask(a, p.Goodbye(7)) == p.Ok(7)
        pools = ask(admin, p.Pools(4))
        assert isinstance(pools, p.PoolsResult) and [pi.sessions for pi in pools.pools] == [0]
        inv = ask(admin, p.CheckInvariants(5, daemon.admin_token))
        assert isinstance(inv, p.InvariantsResult) and inv.problems == []
    finally:
        for sock in socks:
            sock.close()
        daemon.stop()
