"""Runs in the test process: the fuzzer's model of the daemon and the driver that checks it.

`Model` is the reference model of the daemon's state: for each request it
computes the reply the daemon must give (the session, role, pool and job rules
of SPEC sections 3 to 7 over the pure core the daemon runs, `OwnedIndex` over
`BlockIndex`) and moves its state as the daemon's must move. `Fuzz` is the
driver: it owns the peers' sockets, homes them, sends each `Input`, plays the
fake worker, and checks every reply against the model. `FLAGS` starts the
daemon in the configuration the model replays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import zmq

from kvd.control.service import POOL_VERBS
from kvd.core.index import BlockIndex
from kvd.core.ownership import OwnedIndex
from kvd.version import __version__
from kvd_client import protocol as p
from kvd_client.errors import ErrorCode, KvdError
from kvd_client.geometry import Geometry
from kvd_tools.launcher import DaemonProcess

LEASE_MS = 600_000  # nothing expires during the run: the model has no clock
MAX_TOTAL = 64 << 20
DEFAULT_POOL = 1 << 20
FLAGS = {
    "lease-ms": str(LEASE_MS),
    "job-timeout-ms": str(LEASE_MS),
    "max-total-bytes": str(MAX_TOTAL),
    "default-pool-bytes": str(DEFAULT_POOL),
    "prefault": "false",
    "policy": "lru",  # the model replays LRU exactly
    "log-level": "warning",
    "metrics-addr": "none",
}
FZ = p.Layout("fz-model@1", "bfloat16", 16, 1, False, 256)
FZ_CAPACITY = 64 * 256  # 64 blocks: full quickly, so stores evict and fail to fit
HOMES: dict[str, tuple[p.Role, str, str | None]] = {
    "admin": ("admin", "", None),
    "sched": ("scheduler", "fz", "fz"),
    "lonely": ("scheduler", "lonely", "fz"),
    "worker": ("worker", "fz", "fz"),
    "attacher": ("scheduler", "fz-a", None),
}
_ENVELOPE = msgspec.msgpack.Decoder(list[msgspec.Raw])


def envelope_req_id(frame: bytes) -> int:
    """The req_id an Error to an invalid frame echoes: a valid one in the envelope, else 0."""
    try:
        items = _ENVELOPE.decode(frame)
        req_id = msgspec.msgpack.decode(items[1], type=int) if len(items) > 1 else 0
    except (msgspec.DecodeError, RecursionError):
        return 0
    return req_id if 0 <= req_id < 1 << 63 else 0


# -- the model -----------------------------------------------------------------


@dataclass(eq=False)
class Peer:
    name: str
    sock: zmq.Socket[bytes]
    session: int | None = None
    role: str = ""
    engine_id: str = ""
    rank: int = 0
    world_size: int = 1
    pool: str | None = None
    generation: int = 0


@dataclass
class PoolModel:
    layout: p.Layout
    geometry: Geometry
    generation: int
    owned: OwnedIndex
    sessions: int = 0

    def info(self, name: str) -> p.PoolInfo:
        g, ix = self.geometry, self.owned.index
        return p.PoolInfo(
            name,
            f"/kvd.{name}.{self.generation}",
            self.generation,
            self.layout,
            "lru",
            g.num_blocks,
            g.row_bytes,
            g.size_bytes,
            ix.num_ready,
            ix.num_in_flight,
            ix.num_pinned,
            ix.num_free,
            self.sessions,
        )


class Mismatch(AssertionError):
    """The daemon answered differently from the model."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise Mismatch(what)


def bad_request(reply: p.Reply, req_id: int, what: str) -> p.Reply:
    ok = isinstance(reply, p.Error) and (reply.req_id, reply.code) == (req_id, "BAD_REQUEST")
    expect(ok, f"{what}: expected BAD_REQUEST for req_id {req_id}, got {reply!r}")
    return reply


@dataclass
class Model:
    """What the daemon must answer and how its state moves, request by request."""

    pools: dict[str, PoolModel] = field(default_factory=dict)
    sessions: dict[int, Peer] = field(default_factory=dict)
    workers: dict[tuple[str, str], dict[int, Peer]] = field(default_factory=dict)
    results: dict[int, list[tuple[int, bool]]] = field(default_factory=dict)
    next_session: int | None = None
    next_job: int = 1
    # Sessions the daemon held before the fuzzer began, such as one whose
    # Welcome came after a start-up probe had given up; they live on until
    # their (long) lease runs out.
    outside: int = 0
    admin_token: str = ""  # the daemon's operator token, which DropPool needs
    # The daemon's slot of each key, learned from its replies. Slot ids are
    # compared as a mapping, not as numbers: a session's in-flight stores are
    # freed in `set` order (hash seeds differ between processes), so the LIFO
    # reuse of freed ids differs between the daemon and this model.
    slots: dict[tuple[str, int], dict[bytes, int]] = field(default_factory=dict)

    def learn(self, name: str, pm: PoolModel, keys: list[bytes], got: list[int]) -> None:
        """Slots the daemon just allocated to `keys`: distinct, in range, no resident key's."""
        table = self.slots.setdefault((name, pm.generation), {})
        num = pm.geometry.num_blocks
        expect(
            len(got) == len(keys) and len(set(got)) == len(got) and all(0 <= x < num for x in got),
            f"slots {got!r} for {len(keys)} keys of a {num}-block pool",
        )
        mine = set(keys)
        taken = {x for k, x in table.items() if k not in mine and k in pm.owned.index}
        expect(not taken & set(got), f"slots {sorted(taken & set(got))} are held by other keys")
        if len(table) > 4 * num:
            table = {k: x for k, x in table.items() if k in pm.owned.index}
            self.slots[(name, pm.generation)] = table
        table.update(zip(keys, got, strict=True))

    def slots_of(self, name: str, pm: PoolModel, keys: list[bytes]) -> list[int]:
        table = self.slots.get((name, pm.generation), {})
        return [table[k] for k in keys]

    def handle(self, peer: Peer, req: p.Request, reply: p.Reply, fuzz: Fuzz, ack_ok: bool) -> None:
        rid = req.req_id
        try:
            expected = self._answer(peer, req, reply, fuzz, ack_ok)
        except KvdError as exc:
            expect(
                isinstance(reply, p.Error) and (reply.req_id, reply.code) == (rid, exc.code),
                f"expected Error {exc.code} ({exc.detail}), got {reply!r}"[:3000],
            )
            return
        expect(reply == expected, f"expected {expected!r}, got {reply!r}"[:3000])

    def _answer(
        self, peer: Peer, req: p.Request, reply: p.Reply, fuzz: Fuzz, ack_ok: bool
    ) -> p.Reply:
        rid = req.req_id
        if isinstance(req, p.Hello):
            return self._hello(peer, req, reply)
        sid = peer.session
        if sid is None:
            raise KvdError("send Hello first", ErrorCode.NOT_HELLO)
        if isinstance(req, POOL_VERBS):
            pm = self._pool_of(peer)
            if peer.role != "scheduler":
                raise KvdError("wrong role", ErrorCode.WRONG_ROLE)
            return self._verb(peer, sid, pm, req, reply, fuzz, ack_ok)
        match req:
            case p.Attach():
                return self._attach(peer, req, reply)
            case p.Heartbeat():
                if peer.pool is not None:
                    self._pool_of(peer)
                return p.Ok(rid)
            case p.Finished():
                got = reply.results if isinstance(reply, p.FinishedResult) else []
                want = self.results.pop(sid, [])
                expect([(r.job_id, r.ok) for r in got] == want, f"results {got!r} != {want!r}")
                return p.FinishedResult(rid, got)
            case p.JobDone():
                if peer.role != "worker":
                    raise KvdError("only a worker may send JobDone", ErrorCode.WRONG_ROLE)
                if req.rank != peer.rank:
                    raise KvdError("not this rank", ErrorCode.NOT_OWNER)
                return p.Ok(rid)  # no job is ever left pending: an unknown job is ignored
            case p.Stats():
                return self._stats(rid, reply)
            case p.Pools():
                return p.PoolsResult(rid, [pm.info(name) for name, pm in self.pools.items()])
            case p.DropPool():
                if req.token != self.admin_token:
                    raise KvdError("not the operator token", ErrorCode.WRONG_ROLE)
                if req.pool not in self.pools:
                    raise KvdError("no such pool", ErrorCode.NO_SUCH_POOL)
                del self.pools[req.pool]
                return p.Ok(rid)
            case p.Reset():
                if req.pool not in self.pools:
                    raise KvdError("no such pool", ErrorCode.NO_SUCH_POOL)
                self.pools[req.pool].owned.reset()
                return p.Ok(rid)
            case p.CheckInvariants():
                return p.InvariantsResult(rid, [])
            case p.Goodbye():
                self.end(peer)
                return p.Ok(rid)
        raise AssertionError(f"the model does not know {req!r}")

    def _pool_of(self, peer: Peer) -> PoolModel:
        if peer.pool is None:
            raise KvdError("send Attach first", ErrorCode.NOT_ATTACHED)
        pm = self.pools.get(peer.pool)
        if pm is None or pm.generation != peer.generation:
            raise KvdError("pool dropped", ErrorCode.NO_SUCH_POOL)
        return pm

    def _verb(
        self,
        peer: Peer,
        sid: int,
        pm: PoolModel,
        req: p.Request,
        reply: p.Reply,
        fuzz: Fuzz,
        ack_ok: bool,
    ) -> p.Reply:
        owned, rid, name = pm.owned, req.req_id, peer.pool
        assert name is not None
        match req:
            case p.Lookup(_, keys):
                return p.LookupResult(rid, owned.index.lookup(keys))
            case p.Touch(_, keys):
                owned.index.touch(keys)
                return p.Ok(rid)
            case p.PrepareLoad(_, keys):
                owned.prepare_load(sid, keys, account=sid)
                return p.SlotsResult(rid, self.slots_of(name, pm, keys))
            case p.CompleteLoad(_, keys):
                owned.complete_load(sid, keys)
                return p.Ok(rid)
            case p.PrepareStore(_, keys):
                out = owned.prepare_store(sid, keys)
                if out is None:
                    return p.PrepareStoreResult(rid, False)
                got = reply.slots if isinstance(reply, p.PrepareStoreResult) else []
                self.learn(name, pm, out.keys_to_store, got)
                return p.PrepareStoreResult(rid, True, out.keys_to_store, got, out.evicted_keys)
            case p.CompleteStore(_, keys, success):
                owned.complete_store(sid, keys, success)
                return p.Ok(rid)
            case p.Store(_, keys, ids) | p.Load(_, keys, ids):
                if len(keys) != len(ids):
                    raise KvdError("lengths differ", ErrorCode.BAD_REQUEST)
                ranks = self.workers.get((name, peer.engine_id), {})
                worker = ranks.get(0)
                if worker is None or worker.generation != pm.generation:
                    raise KvdError("no worker", ErrorCode.WORKERS_MISSING)
                job_id, self.next_job = self.next_job, self.next_job + 1
                owner = ("job", job_id)
                if isinstance(req, p.Load):
                    owned.prepare_load(owner, keys, account=sid)
                    slots = self.slots_of(name, pm, keys)
                    job = p.TransferJob(0, job_id, "load", name, pm.generation, ids, slots, True)
                    fuzz.run_job(worker, job, ack_ok)
                    owned.complete_load(owner, keys)
                    self.results.setdefault(sid, []).append((job_id, ack_ok))
                    return p.LoadTicket(rid, job_id)
                out = owned.prepare_store(owner, keys)
                if out is None:
                    return p.StoreTicket(rid, False)
                if not out.keys_to_store:
                    return p.StoreTicket(rid, True, None, [], out.evicted_keys)
                device_of = dict(zip(keys, ids, strict=True))
                job_ids = [device_of[k] for k in out.keys_to_store]
                job = p.TransferJob(0, job_id, "store", name, pm.generation, job_ids, [], True)
                got = fuzz.run_job(worker, job, ack_ok)
                self.learn(name, pm, out.keys_to_store, got)
                owned.complete_store(owner, out.keys_to_store, success=ack_ok)
                self.results.setdefault(sid, []).append((job_id, ack_ok))
                return p.StoreTicket(rid, True, job_id, out.keys_to_store, out.evicted_keys)
        raise AssertionError(f"not a pool verb: {req!r}")

    def _hello(self, peer: Peer, req: p.Hello, reply: p.Reply) -> p.Reply:
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise KvdError("version", ErrorCode.UNSUPPORTED_VERSION)
        if not 1 <= req.world_size <= 1024 or not 0 <= req.rank < req.world_size:
            raise KvdError("rank", ErrorCode.BAD_REQUEST)
        if len(req.engine_id) > p.MAX_NAME_CHARS:
            raise KvdError("engine_id", ErrorCode.BAD_REQUEST)
        self.end(peer)
        expect(isinstance(reply, p.Welcome), f"expected Welcome, got {reply!r}")
        assert isinstance(reply, p.Welcome)
        if self.next_session is None:
            self.next_session = reply.session_id
        sid, self.next_session = self.next_session, self.next_session + 1
        peer.session, peer.role, peer.engine_id = sid, req.role, req.engine_id
        peer.rank, peer.world_size = req.rank, req.world_size
        self.sessions[sid] = peer
        return p.Welcome(req.req_id, sid, LEASE_MS, __version__)

    def _attach(self, peer: Peer, req: p.Attach, reply: p.Reply) -> p.Reply:
        name, lay = req.pool, req.layout
        if not p.valid_pool_name(name):
            raise KvdError("pool name", ErrorCode.BAD_REQUEST)
        if peer.pool is not None and peer.pool != name:
            raise KvdError("attached elsewhere", ErrorCode.BAD_REQUEST)
        if peer.role == "worker" and peer.world_size != lay.world_size:
            raise KvdError("world_size", ErrorCode.BAD_REQUEST)
        pm = self.pools.get(name)
        if pm is not None and pm.layout != lay:
            raise KvdError("layout", ErrorCode.LAYOUT_MISMATCH)
        if pm is None:
            if min(lay.block_tokens, lay.world_size, lay.slot_bytes) < 1 or lay.world_size > 1024:
                raise KvdError("layout", ErrorCode.BAD_REQUEST)
            room = MAX_TOTAL - sum(x.geometry.size_bytes for x in self.pools.values())
            wanted = DEFAULT_POOL if req.capacity_bytes is None else req.capacity_bytes
            if wanted < 1:
                raise KvdError("capacity", ErrorCode.BAD_REQUEST)
            if req.capacity_bytes is not None and req.capacity_bytes > room:
                raise KvdError("capacity", ErrorCode.TOO_LARGE)
            g = Geometry.plan(
                slot_bytes=lay.slot_bytes,
                world_size=lay.world_size,
                replicated=lay.replicated,
                capacity_bytes=min(wanted, room),
            )
            expect(isinstance(reply, p.Attached), f"expected Attached, got {reply!r}")
            assert isinstance(reply, p.Attached)
            index = BlockIndex(g.num_blocks, "lru", lay.block_tokens)
            owned = OwnedIndex(index, max(1, int(g.num_blocks * 0.5)))
            pm = self.pools[name] = PoolModel(lay, g, reply.generation, owned)
        if (peer.pool, peer.generation) != (name, pm.generation):
            pm.sessions += 1
        peer.pool, peer.generation = name, pm.generation
        if peer.role == "worker":
            ranks = self.workers.setdefault((name, peer.engine_id), {})
            old = ranks.get(peer.rank)
            ranks[peer.rank] = peer
            if old is not None and old is not peer:
                self.end(old)
        g = pm.geometry
        return p.Attached(
            req.req_id,
            f"/kvd.{name}.{pm.generation}",
            pm.generation,
            g.num_blocks,
            g.row_bytes,
            g.slot_bytes,
            g.num_slots,
            g.slot_stride,
        )

    def _stats(self, rid: int, reply: p.Reply) -> p.Reply:
        expect(isinstance(reply, p.StatsResult), f"expected StatsResult, got {reply!r}")
        assert isinstance(reply, p.StatsResult)
        return p.StatsResult(
            rid,
            __version__,
            reply.uptime_s,
            len(self.sessions) + self.outside,
            0,
            0,
            MAX_TOTAL,
            sum(pm.geometry.size_bytes for pm in self.pools.values()),
            [pm.info(name) for name, pm in self.pools.items()],
            reply.counters,
        )

    def end(self, peer: Peer) -> None:
        """The session of `peer` ends (Goodbye, a new Hello, a worker replaced): rolled back."""
        if peer.session is None:
            return
        del self.sessions[peer.session]
        self.results.pop(peer.session, None)
        pm = self.pools.get(peer.pool) if peer.pool is not None else None
        if pm is not None and pm.generation == peer.generation:
            pm.sessions -= 1
            pm.owned.release(peer.session)
        if peer.role == "worker" and peer.pool is not None:
            ranks = self.workers.get((peer.pool, peer.engine_id), {})
            if ranks.get(peer.rank) is peer:
                del ranks[peer.rank]
        peer.session, peer.role, peer.pool, peer.generation = None, "", None, 0


# -- the driver ----------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    peer: str
    frame: bytes | tuple[bytes, ...]  # a tuple is sent as one multipart message
    ack_ok: bool = True
    oversized: bool = False


class Fuzz:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.model = Model()
        names = ["fresh", "hello", *HOMES]
        self.peers = {name: Peer(name, self._socket()) for name in names}
        self.dropped: list[zmq.Socket[bytes]] = []
        self.count = 0
        self.seen: set[type] = set()
        self.codes: dict[str, int] = {}
        self.req_id = 1 << 40  # the driver's own requests

    def _socket(self) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.daemon.endpoint)
        return sock

    def close(self) -> None:
        for peer in self.peers.values():
            peer.sock.close()
        for sock in self.dropped:
            sock.close()

    def receive(self, peer: Peer) -> p.Reply:
        if not peer.sock.poll(20_000):
            alive = self.daemon.proc is not None and self.daemon.proc.poll() is None
            raise AssertionError(f"no reply to {peer.name} in 20 s (daemon alive: {alive})")
        raw = peer.sock.recv()
        try:
            return p.reply_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise Mismatch(f"a reply no client can decode ({exc}): {raw[:200]!r}") from None

    def feed(self, inp: Input) -> None:
        """One fuzz input: home the peers, send, check the reply against the model."""
        self.count += 1
        if inp.oversized:
            sock = self._socket()  # the transport drops the frame and this peer
            assert isinstance(inp.frame, bytes)
            sock.send(inp.frame)
            self.dropped.append(sock)
            return
        self.home()
        self.exchange(self.peers[inp.peer], inp.frame, inp.ack_ok, counted=True)
        if self.count % 500 == 0:
            self.checkpoint()

    def exchange(
        self, peer: Peer, frame: bytes | tuple[bytes, ...], ack_ok: bool, counted: bool
    ) -> p.Reply:
        if isinstance(frame, tuple):
            peer.sock.send_multipart(list(frame))
        else:
            peer.sock.send(frame)
        reply = self.receive(peer)
        if isinstance(reply, p.Error):
            self.codes[reply.code] = self.codes.get(reply.code, 0) + 1
            expect(bool(reply.detail), f"an Error without detail: {reply!r}")
        if isinstance(frame, tuple):  # the daemon takes one frame per message
            return bad_request(reply, 0, "a multipart message")
        try:
            req = p.request_decoder.decode(frame)
        except msgspec.ValidationError:  # well-formed msgpack outside the schema
            return bad_request(reply, envelope_req_id(frame), f"{frame[:200]!r}")
        except msgspec.DecodeError:
            return bad_request(reply, 0, f"undecodable {frame[:200]!r}")
        if counted:
            self.seen.add(type(req))
        try:
            self.model.handle(peer, req, reply, self, ack_ok)
        except Mismatch as exc:
            raise Mismatch(f"{peer.name} sent {str(req)[:1500]}: {exc}") from None
        return reply

    def request(self, peer: Peer, msg: p.Request) -> p.Reply:
        """A request of the driver itself (homing peers), checked like any input."""
        return self.exchange(peer, p.encoder.encode(msg), True, counted=False)

    def rid(self) -> int:
        self.req_id += 1
        return self.req_id

    def run_job(self, worker: Peer, job: p.TransferJob, ack_ok: bool) -> list[int]:
        """The fake worker: receives the pushed job, checks it, acknowledges it.

        Returns the job's slots; a store job's are checked by the caller (`job`
        carries none).
        """
        pushed = self.receive(worker)
        if job.kind == "store" and isinstance(pushed, p.TransferJob):
            job = msgspec.structs.replace(job, pool_block_ids=pushed.pool_block_ids)
        expect(pushed == job, f"pushed {pushed!r}, expected {job!r}")
        ack = p.JobDone(self.rid(), job.job_id, 0, ack_ok, 0, 0.0, "")
        worker.sock.send(p.encoder.encode(ack))
        reply = self.receive(worker)
        expect(reply == p.Ok(ack.req_id), f"JobDone answered {reply!r}")
        return job.pool_block_ids

    def home(self) -> None:
        """Puts every peer back in its home state (fuzz inputs can move them)."""
        fresh = self.peers["fresh"]
        if fresh.session is not None:
            self.request(fresh, p.Goodbye(self.rid()))
        for extra in [n for n in self.model.pools if n not in ("fz", "fz-b", "fz-c")][:-3]:
            self.request(self.peers["admin"], p.DropPool(self.rid(), extra, self.model.admin_token))
        for name, (role, engine, pool) in HOMES.items():
            peer = self.peers[name]
            pm = self.model.pools.get(pool) if pool else None
            at_home = (
                peer.session is not None
                and (peer.role, peer.engine_id, peer.rank, peer.pool) == (role, engine, 0, pool)
                and (pool is None or (pm is not None and pm.generation == peer.generation))
            )
            if at_home:
                continue
            if peer.session is not None:
                self.request(peer, p.Goodbye(self.rid()))
            self.request(peer, p.Hello(self.rid(), p.PROTOCOL_VERSION, role, engine, 0, 1, 1))
            if pool is not None:
                self.request(peer, p.Attach(self.rid(), pool, FZ, FZ_CAPACITY))

    def count_outside_sessions(self) -> None:
        admin = self.peers["admin"]
        admin.sock.send(p.encoder.encode(p.Stats(self.rid())))
        reply = self.receive(admin)
        assert isinstance(reply, p.StatsResult), reply
        self.model.outside = reply.sessions - len(self.model.sessions)
        assert 0 <= self.model.outside <= 2, f"{reply.sessions} sessions before the fuzzing"

    def checkpoint(self) -> None:
        admin = self.peers["admin"]
        self.home()
        self.request(admin, p.CheckInvariants(self.rid()))
        self.request(admin, p.Stats(self.rid()))
        for sock in self.dropped:
            assert not sock.poll(0), "an oversized frame got a reply"
            sock.close()
        self.dropped.clear()
