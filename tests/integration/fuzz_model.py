"""Runs in the test process: the fuzzer's model of the daemon and the driver that checks it.

`Model` is the reference model of the daemon's state: for each request it
computes the reply the daemon must give (the session, role, pool, reset and
job rules of SPEC sections 3 to 7 and 11 over the pure index core the daemon
runs, `OwnedIndex` over `BlockIndex`; the job state machine is the model's
own) and moves its state as the daemon's must move. `Fuzz` is the driver: it
owns the peers' sockets, homes them, sends each `Input`, plays the fake
worker (acknowledging a job at once or leaving it live for later inputs),
and checks every reply and every pushed job against the model. `FLAGS`
starts the daemon in the configuration the model replays.

The model has no clock, so nothing may depend on one: leases and job
timeouts are far longer than a run, and the driver ends what only time would
end within `MAX_AGE` inputs: it acknowledges a job left live, completes what
the sessions holding up a pending reset hold, and drops a pool whose slots
only a lease would free (a job whose rank went away without a goodbye, the
slots of a session that ended). Where the daemon's tick alone would finish a
reset (its last pin or store completed), the driver makes the daemon retry
it at once (`Fuzz.retry_resets`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import zmq

from kvd.control.observed import check_observe
from kvd.control.service import POOL_VERBS
from kvd.core.index import BlockIndex
from kvd.core.ownership import OwnedIndex
from kvd.version import __version__
from kvd_client import protocol as p
from kvd_client.errors import ErrorCode, KvdError
from kvd_client.geometry import Geometry
from kvd_client.ready_table import table_bytes, table_name
from kvd_client.segment import SegmentHeader
from kvd_tools.launcher import DaemonProcess

LEASE_MS = 3_600_000  # nothing expires during a run (100,000 inputs take minutes)
JOB_TIMEOUT_S = LEASE_MS / 1000
MAX_TOTAL = 64 << 20
DEFAULT_POOL = 1 << 20
MAX_RESULTS = 65_536  # the daemon's max_pending_results
MAX_SESSIONS = 4096  # the daemon's max_sessions (it remembers as many departed workers)
FLAGS = {
    "lease-ms": str(LEASE_MS),
    "job-timeout-ms": str(LEASE_MS),
    "max-total-bytes": str(MAX_TOTAL),
    "default-pool-bytes": str(DEFAULT_POOL),
    "max-pending-results": str(MAX_RESULTS),
    "max-sessions": str(MAX_SESSIONS),
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
    "worker": ("worker", "fz", "fz"),  # played by the peer `Fuzz.worker_name` names
    "attacher": ("scheduler", "fz-a", None),
    "impostor": ("worker", "fz", None),  # engine fz's rank 0 too, never attached
}
WORKER_INSTANCE = "fz-worker-1"
# Inputs a live job, a job or session held for a lease, or a pending reset may
# last before the driver ends it (`Fuzz.tidy`).
MAX_AGE = 40
Ack = Literal["ok", "fail", "later"]
Rejoin = Literal["same", "none", "other", "back"]
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
    instance: str = ""  # of its latest Hello (kept after the session ends)


@dataclass
class PoolModel:
    layout: p.Layout
    geometry: Geometry
    generation: int
    owned: OwnedIndex
    sessions: int = 0
    resetting: bool = False
    reset_since: int = 0  # the input that started the pending reset
    held_since: dict[int, int] = field(default_factory=dict)  # ended session -> input

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


@dataclass(eq=False)
class JobModel:
    """One transfer job: reported once (ok or failed), settled once no rank can copy."""

    job_id: int
    kind: str
    pool: str
    generation: int
    session: int  # the scheduler's
    engine: str
    keys: list[bytes]
    pushed_to: dict[int, int]  # rank -> the worker session it was pushed to
    pushes: dict[int, p.TransferJob]  # by rank, as they must arrive (deadline aside)
    born: int
    deadline: float = 0.0  # learned from its first push
    acked: dict[int, bool] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    # Ranks whose session ended without saying its copies stopped: gone one
    # lease later, which no run reaches, so they stay pending.
    held: set[int] = field(default_factory=set)
    held_since: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    failure: str = ""
    said: str = ""  # the detail of the rank whose JobDone failed it
    reported: bool = False

    @property
    def owner(self) -> tuple[str, int]:
        return ("job", self.job_id)

    @property
    def pending(self) -> list[int]:
        return sorted(set(self.pushed_to) - self.acked.keys() - self.gone)

    @property
    def ok(self) -> bool:
        return not self.failure and all(self.acked.get(r, False) for r in self.pushed_to)


# (job_id, ok, nbytes, seconds, the failing rank's detail) as the scheduler must see it
Result = tuple[int, bool, int, float, str]


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
    results: dict[int, list[Result]] = field(default_factory=dict)
    jobs: dict[int, JobModel] = field(default_factory=dict)  # not settled, in creation order
    next_session: int | None = None
    # Job ids count up from where the daemon starts them (learned from the first
    # ticket that names one), one per Store or Load that passed its checks.
    first_job: int | None = None
    num_job_ids: int = 0
    # Sessions the daemon held before the fuzzer began, such as one whose
    # Welcome came after a start-up probe had given up; they live on until
    # their (long) lease runs out.
    outside: int = 0
    admin_token: str = ""  # the daemon's operator token (DropPool, CheckInvariants, Reset)
    # The daemon's slot of each key, learned from its replies. Slot ids are
    # compared as a mapping, not as numbers: a session's in-flight stores are
    # freed in `set` order (hash seeds differ between processes), so the LIFO
    # reuse of freed ids differs between the daemon and this model.
    slots: dict[tuple[str, int], dict[bytes, int]] = field(default_factory=dict)
    now: int = 0  # the driver's input count: the model's only clock
    # Keys each session pinned (True) or began to store (False), for inputs that
    # complete them; not pruned as they complete: completing twice is an input too.
    prepared: dict[tuple[int, bool], list[bytes]] = field(default_factory=dict)
    # (worker, job, rank, again) the daemon must push; again = a rebound job's push
    pushes: list[tuple[Peer, JobModel, int, bool]] = field(default_factory=list)
    # A pending reset became drainable without the daemon retrying it (a
    # CompleteLoad or CompleteStore): its tick would finish it at a moment of
    # its own, so the driver sends a request that retries it now.
    poke: bool = False
    events: Counter[str] = field(default_factory=Counter)
    # Worker sessions that ended without a goodbye, by instance: the daemon's memory
    # of whose jobs a process coming back may take over.
    departed: dict[str, int] = field(default_factory=dict)

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

    def ready_keys(self, name: str) -> list[bytes]:
        """Keys ready in pool `name`, in the order their slots were learned."""
        pm = self.pools.get(name)
        if pm is None:
            return []
        ix = pm.owned.index
        table = self.slots.get((name, pm.generation), {})
        return [k for k in table if k in ix and ix.is_ready(k)]

    def slots_of(self, name: str, pm: PoolModel, keys: list[bytes]) -> list[int]:
        table = self.slots.get((name, pm.generation), {})
        return [table[k] for k in keys]

    def handle(self, peer: Peer, req: p.Request, reply: p.Reply) -> None:
        rid = req.req_id
        try:
            expected = self._answer(peer, req, reply)
        except KvdError as exc:
            expect(
                isinstance(reply, p.Error) and (reply.req_id, reply.code) == (rid, exc.code),
                f"expected Error {exc.code} ({exc.detail}), got {reply!r}"[:3000],
            )
            return
        expect(reply == expected, f"expected {expected!r}, got {reply!r}"[:3000])

    def _answer(self, peer: Peer, req: p.Request, reply: p.Reply) -> p.Reply:
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
            return self._verb(peer, sid, pm, req, reply)
        match req:
            case p.Attach():
                return self._attach(peer, req, reply)
            case p.Heartbeat():
                if peer.pool is not None:
                    self._pool_of(peer)
                return p.Ok(rid)
            case p.Finished():
                return self._finished(sid, rid, reply)
            case p.JobDone():
                return self._job_done(peer, sid, req)
            case p.Stats():
                return self._stats(rid, reply)
            case p.Pools():
                return p.PoolsResult(rid, [pm.info(name) for name, pm in self.pools.items()])
            case p.DropPool():
                if req.token != self.admin_token:
                    raise KvdError("not the operator token", ErrorCode.WRONG_ROLE)
                if req.pool not in self.pools:
                    raise KvdError("no such pool", ErrorCode.NO_SUCH_POOL)
                self._fail_all(req.pool)
                pm = self.pools.pop(req.pool)
                self.slots.pop((req.pool, pm.generation), None)
                self.events["pools dropped"] += 1
                return p.Ok(rid)
            case p.Reset():
                return self._reset(peer, req)
            case p.CheckInvariants():
                if req.token != self.admin_token:
                    raise KvdError("not the operator token", ErrorCode.WRONG_ROLE)
                return p.InvariantsResult(rid, [])
            case p.Goodbye():
                self.end(peer, certain=True)
                return p.Ok(rid)
        raise AssertionError(f"the model does not know {req!r}")

    def _pool_of(self, peer: Peer) -> PoolModel:
        if peer.pool is None:
            raise KvdError("send Attach first", ErrorCode.NOT_ATTACHED)
        pm = self.pools.get(peer.pool)
        if pm is None or pm.generation != peer.generation:
            raise KvdError("pool dropped", ErrorCode.NO_SUCH_POOL)
        return pm

    def _verb(self, peer: Peer, sid: int, pm: PoolModel, req: p.Request, reply: p.Reply) -> p.Reply:
        owned, rid, name = pm.owned, req.req_id, peer.pool
        assert name is not None
        if isinstance(req, p.Observe):  # its keys and hit counts are checked first
            check_observe(req)
        if pm.resetting and not isinstance(req, p.CompleteLoad | p.CompleteStore):
            # No hits and no new transfers while a reset waits (completions drain it).
            self.events["verbs while resetting"] += 1
            match req:
                case p.Lookup():
                    return p.LookupResult(rid, 0)
                case p.Touch() | p.Observe():
                    return p.Ok(rid)
                case p.PrepareStore():
                    return p.PrepareStoreResult(rid, False)
                case p.Store():
                    return p.StoreTicket(rid, False)
            raise KvdError("pool is being reset", ErrorCode.MISSING)
        match req:
            case p.Lookup(_, keys, pin):
                hits = owned.index.lookup(keys)
                if not (pin and hits):
                    return p.LookupResult(rid, hits)
                owned.prepare_load(sid, keys[:hits], account=sid)  # the same step
                self.prepared.setdefault((sid, True), []).extend(keys[:hits])
                return p.LookupResult(rid, hits, self.slots_of(name, pm, keys[:hits]))
            case p.Touch(_, keys):
                owned.index.touch(keys)
                return p.Ok(rid)
            case p.Observe(_, lookups):
                for keys in lookups:
                    owned.index.observe(keys)
                return p.Ok(rid)
            case p.PrepareLoad(_, keys):
                owned.prepare_load(sid, keys, account=sid)
                self.prepared.setdefault((sid, True), []).extend(keys)
                return p.SlotsResult(rid, self.slots_of(name, pm, keys))
            case p.CompleteLoad(_, keys):
                owned.complete_load(sid, keys)
                self._drains(name, pm)
                return p.Ok(rid)
            case p.PrepareStore(_, keys):
                out = owned.prepare_store(sid, keys)
                if out is None:
                    return p.PrepareStoreResult(rid, False)
                got = reply.slots if isinstance(reply, p.PrepareStoreResult) else []
                self.learn(name, pm, out.keys_to_store, got)
                self.prepared.setdefault((sid, False), []).extend(out.keys_to_store)
                return p.PrepareStoreResult(rid, True, out.keys_to_store, got, out.evicted_keys)
            case p.CompleteStore(_, keys, success):
                owned.complete_store(sid, keys, success)
                self._drains(name, pm)
                return p.Ok(rid)
            case p.Store(_, keys, ids) | p.Load(_, keys, ids):
                return self._transfer(peer, sid, name, pm, req, keys, ids, reply)
        raise AssertionError(f"not a pool verb: {req!r}")

    def _transfer(
        self,
        peer: Peer,
        sid: int,
        name: str,
        pm: PoolModel,
        req: p.Request,
        keys: list[bytes],
        ids: list[int],
        got: p.Reply,
    ) -> p.Reply:
        rid, owned = req.req_id, pm.owned
        if len(keys) != len(ids):
            raise KvdError("lengths differ", ErrorCode.BAD_REQUEST)
        ranks = {
            rank: w
            for rank, w in self.workers.get((name, peer.engine_id), {}).items()
            if w.generation == pm.generation
        }
        if any(r not in ranks for r in range(pm.layout.world_size)):
            raise KvdError("no worker", ErrorCode.WORKERS_MISSING)
        job_id = self._new_job_id(got)  # spent even if nothing fits
        owner = ("job", job_id)
        if isinstance(req, p.Load):
            owned.prepare_load(owner, keys, account=sid)
            slots, job_keys, job_ids, writers = self.slots_of(name, pm, keys), keys, ids, set(ranks)
            reply: p.Reply = p.LoadTicket(rid, job_id)
        else:
            out = owned.prepare_store(owner, keys)
            if out is None:
                return p.StoreTicket(rid, False)
            if not out.keys_to_store:
                return p.StoreTicket(rid, True, None, [], out.evicted_keys)
            device_of = dict(zip(keys, ids, strict=True))
            job_keys, slots = out.keys_to_store, []  # the slots come with the push
            job_ids = [device_of[k] for k in job_keys]
            writers = {0} if pm.layout.replicated else set(ranks)
            reply = p.StoreTicket(rid, True, job_id, out.keys_to_store, out.evicted_keys)
        kind: Literal["store", "load"] = "load" if isinstance(req, p.Load) else "store"
        pushes = {
            rank: p.TransferJob(
                0, job_id, kind, name, pm.generation, job_ids, slots, rank in writers
            )
            for rank in sorted(ranks)
        }
        pushed_to = {rank: w.session for rank, w in ranks.items() if w.session is not None}
        job = JobModel(
            job_id, kind, name, pm.generation, sid, peer.engine_id, job_keys, pushed_to, pushes,
            self.now,
        )  # fmt: skip
        self.jobs[job_id] = job
        self.events[f"{kind} jobs"] += 1
        self.pushes.extend((ranks[rank], job, rank, False) for rank in sorted(ranks))
        return reply

    def _new_job_id(self, reply: p.Reply) -> int:
        if self.first_job is None:
            named = (
                getattr(reply, "job_id", None)
                if isinstance(reply, p.StoreTicket | p.LoadTicket)
                else None
            )
            if named is None:
                self.num_job_ids += 1
                return -1  # never shown: no ticket names it
            self.first_job = named - self.num_job_ids
        self.num_job_ids += 1
        return self.first_job + self.num_job_ids - 1

    def latest_job(self) -> int:
        """The id of the latest job, or of none."""
        return -1 if self.first_job is None else self.first_job + self.num_job_ids - 1

    def pushed(
        self, job: JobModel, rank: int, again: bool, got: p.Reply, t_send: float, t_recv: float
    ) -> None:
        """The TransferJob rank `rank` received for `job` (`again`: pushed anew to the
        session that inherited it) in reply to a request sent between `t_send` and
        `t_recv`."""
        want = job.pushes[rank]
        expect(isinstance(got, p.TransferJob), f"expected the push {want!r}, got {got!r}")
        assert isinstance(got, p.TransferJob)
        if job.deadline:  # a job has one deadline, whichever push carries it
            expect(got.deadline == job.deadline, f"deadline of {got!r} is not {job.deadline}")
        else:
            # The daemon's monotonic clock is this host's: the deadline is its
            # `now` (after our frame arrived, before its reply left) plus the timeout.
            start = got.deadline - JOB_TIMEOUT_S
            expect(
                t_send - 1e-6 <= start <= t_recv + 1e-6,
                f"deadline {got.deadline} is not {JOB_TIMEOUT_S} s after [{t_send}, {t_recv}]",
            )
            job.deadline = got.deadline
        if job.kind == "store" and not again:  # the model's slot ids are not the daemon's
            if rank == min(job.pushes):
                self.learn(job.pool, self.pools[job.pool], job.keys, got.pool_block_ids)
            want = job.pushes[rank] = msgspec.structs.replace(
                want, pool_block_ids=got.pool_block_ids
            )
        got = msgspec.structs.replace(got, deadline=0.0)
        expect(got == want, f"pushed {got!r}, expected {want!r}"[:3000])

    def take_pushes(self) -> list[tuple[Peer, JobModel, int, bool]]:
        pushes, self.pushes = self.pushes, []
        return pushes

    # -- jobs ------------------------------------------------------------------

    def _job_done(self, peer: Peer, sid: int, req: p.JobDone) -> p.Reply:
        if peer.role != "worker":
            raise KvdError("only a worker may send JobDone", ErrorCode.WRONG_ROLE)
        if req.rank != peer.rank:
            raise KvdError("not this rank", ErrorCode.NOT_OWNER)
        job = self.jobs.get(req.job_id)
        if job is not None:  # an unknown (or settled) job is ignored
            if job.engine != peer.engine_id:
                raise KvdError("another engine's job", ErrorCode.NOT_OWNER)
            if job.pushed_to.get(req.rank) != sid:
                raise KvdError("pushed to another session", ErrorCode.NOT_OWNER)
            if req.rank in job.acked:
                raise KvdError("acknowledged twice", ErrorCode.BAD_REQUEST)
            self.events["jobs acked after they failed" if job.failure else "jobs acked"] += 1
            job.acked[req.rank] = req.ok
            job.gone.discard(req.rank)
            job.held.discard(req.rank)
            job.nbytes += max(0, req.nbytes)
            job.seconds = max(job.seconds, req.seconds)
            if not req.ok and not job.failure:
                job.failure, job.said = f"rank {req.rank} failed", req.detail
            self._advance(job)
        self.finish_resets()
        return p.Ok(req.req_id)

    def _advance(self, job: JobModel) -> None:
        """Reports the job once it failed or every rank answered; settles it once none can copy."""
        pending = job.pending
        if not job.reported and (job.failure or not pending):
            job.reported = True
            if job.session in self.sessions:
                results = self.results.setdefault(job.session, [])
                if len(results) >= MAX_RESULTS:
                    del results[: len(results) - MAX_RESULTS // 2]
                results.append((job.job_id, job.ok, job.nbytes, job.seconds, job.said))
        if pending:
            return
        del self.jobs[job.job_id]
        pm = self.pools.get(job.pool)
        if pm is None or pm.generation != job.generation:
            return
        if job.kind == "store":
            pm.owned.complete_store(job.owner, job.keys, success=job.ok)
        else:
            pm.owned.complete_load(job.owner, job.keys)

    def _session_gone(self, sid: int, certain: bool) -> None:
        """A worker session ended: the jobs it owes fail; its ranks are gone now if
        `certain` (its copies stopped), else one lease later."""
        for job in list(self.jobs.values()):
            owed = [r for r in job.pending if job.pushed_to[r] == sid]
            if not owed:
                continue
            if certain:
                job.gone.update(owed)
            else:
                job.held.update(owed)
                job.held_since = self.now
                self.events["jobs held for a lease"] += 1
            job.failure = job.failure or f"rank {owed[0]} went away"
            self._advance(job)

    def _rebind(self, old: int, new: Peer) -> None:
        """`new` reconnects the process behind session `old`: it answers for its jobs,
        and each job still waiting for its rank is pushed to it again."""
        assert new.session is not None
        for job in self.jobs.values():
            for rank, sid in job.pushed_to.items():
                if sid == old:
                    job.pushed_to[rank] = new.session
                    job.held.discard(rank)
                    if rank in job.pending:
                        self.pushes.append((new, job, rank, True))
                        self.events["jobs inherited"] += 1

    def _fail_all(self, pool: str) -> None:
        for job in list(self.jobs.values()):
            if job.pool == pool:
                job.gone.update(job.pending)
                job.failure = job.failure or f"pool {pool} dropped"
                self._advance(job)

    # -- resets ----------------------------------------------------------------

    def _reset(self, peer: Peer, req: p.Reset) -> p.Reply:
        pm = self.pools.get(req.pool)
        if pm is None:
            raise KvdError("no such pool", ErrorCode.NO_SUCH_POOL)
        attached = (peer.pool, peer.generation) == (req.pool, pm.generation)
        if not ((attached and peer.role == "scheduler") or req.token == self.admin_token):
            raise KvdError("needs the token or a scheduler on the pool", ErrorCode.WRONG_ROLE)
        if not pm.resetting:
            pm.resetting, pm.reset_since = True, self.now
            self.events["resets"] += 1
        for job in list(self.jobs.values()):
            if job.pool == req.pool and not job.failure:
                job.failure = f"pool {req.pool} reset"
                self._advance(job)
        self.finish_resets()
        return p.Ok(req.req_id)

    def drained(self, name: str, pm: PoolModel) -> bool:
        return not any(job.pool == name for job in self.jobs.values()) and not pm.owned.owners()

    def _drains(self, name: str, pm: PoolModel) -> None:
        if pm.resetting and self.drained(name, pm):
            self.poke = True

    def finish_resets(self) -> None:
        """What the daemon does after every Reset, JobDone and session end."""
        for name, pm in self.pools.items():
            if pm.resetting and self.drained(name, pm):
                pm.owned.reset()
                pm.resetting = False
                self.slots.pop((name, pm.generation), None)
                self.events["resets done"] += 1

    # -- sessions ----------------------------------------------------------------

    def _hello(self, peer: Peer, req: p.Hello, reply: p.Reply) -> p.Reply:
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise KvdError("version", ErrorCode.UNSUPPORTED_VERSION)
        if not 1 <= req.world_size <= 1024 or not 0 <= req.rank < req.world_size:
            raise KvdError("rank", ErrorCode.BAD_REQUEST)
        if len(req.engine_id) > p.MAX_NAME_CHARS:
            raise KvdError("engine_id", ErrorCode.BAD_REQUEST)
        self.end(peer, certain=True)
        expect(isinstance(reply, p.Welcome), f"expected Welcome, got {reply!r}")
        assert isinstance(reply, p.Welcome)
        if self.next_session is None:
            self.next_session = reply.session_id
        sid, self.next_session = self.next_session, self.next_session + 1
        peer.session, peer.role, peer.engine_id = sid, req.role, req.engine_id
        peer.rank, peer.world_size, peer.instance = req.rank, req.world_size, req.instance
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
            room = MAX_TOTAL - self._used()
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
            overhead = self._data_offset(name, 0, g, lay)  # header and slot table (SPEC 13)
            if overhead + g.size_bytes > room:
                if req.capacity_bytes is not None:
                    raise KvdError("capacity with the slot table", ErrorCode.TOO_LARGE)
                g = Geometry.plan(
                    slot_bytes=lay.slot_bytes,
                    world_size=lay.world_size,
                    replicated=lay.replicated,
                    capacity_bytes=room - overhead,
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
            if old is not None and old is not peer and old.session is not None:
                # Another session takes the rank: the same client process
                # reconnecting (the same non-empty instance) keeps its jobs;
                # otherwise the old one's copies may still run, and its
                # process may still come back for them.
                same = bool(peer.instance) and old.instance == peer.instance
                if same:
                    self._rebind(old.session, peer)
                self.events["workers replaced"] += 1
                self.end(old, certain=False)
                if same:
                    self.departed.pop(peer.instance, None)
        # A worker process whose session ended without a goodbye takes its jobs over.
        came_back = self.departed.pop(peer.instance, None) if peer.instance else None
        if came_back is not None and peer.role == "worker":
            self.events["workers back for their jobs"] += 1
            self._rebind(came_back, peer)
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
            table_name(f"/kvd.{name}.{pm.generation}"),  # the daemon publishes one a pool
            self._data_offset(name, pm.generation, g, req.layout),
        )

    def _used(self) -> int:
        """The daemon's used_bytes: each pool's segment and its ready table."""
        return sum(
            self._data_offset(name, pm.generation, pm.geometry, pm.layout)
            + pm.geometry.size_bytes
            + table_bytes(pm.geometry.num_blocks)
            for name, pm in self.pools.items()
        )

    @staticmethod
    def _data_offset(name: str, generation: int, g: Geometry, layout: p.Layout) -> int:
        """Where the daemon's segment puts the rows (SPEC 13)."""
        return SegmentHeader(generation, g.num_blocks, g.row_bytes, g.slot_bytes, g.num_slots,
                             g.slot_stride, g.replicated, name, msgspec.msgpack.encode(layout),
                             "").data_offset  # fmt: skip

    def _finished(self, sid: int, rid: int, reply: p.Reply) -> p.Reply:
        got = reply.results if isinstance(reply, p.FinishedResult) else []
        want = self.results.pop(sid, [])
        expect(
            [(r.job_id, r.ok, r.nbytes, r.seconds) for r in got] == [w[:4] for w in want],
            f"results {got!r} != {want!r}"[:3000],
        )
        for r, (*_, said) in zip(got, want, strict=True):
            # A failed job says why, and a rank's own reason reaches the scheduler.
            expect(bool(r.detail) != r.ok and said in r.detail, f"result {r!r}: detail {said!r}")
        return p.FinishedResult(rid, got)

    def _stats(self, rid: int, reply: p.Reply) -> p.Reply:
        expect(isinstance(reply, p.StatsResult), f"expected StatsResult, got {reply!r}")
        assert isinstance(reply, p.StatsResult)
        return p.StatsResult(
            rid,
            __version__,
            reply.uptime_s,
            len(self.sessions) + self.outside,
            len(self.jobs),
            0,
            MAX_TOTAL,
            self._used(),
            [pm.info(name) for name, pm in self.pools.items()],
            reply.counters,
        )

    def end(self, peer: Peer, certain: bool) -> None:
        """The session of `peer` ends: what it prepared or pinned is held one lease
        (which no run reaches), however it ended. The jobs a worker owed fail; they
        settle now if `certain` (Goodbye, a new Hello on its socket), else (replaced)
        one lease later, unless its process comes back first."""
        sid = peer.session
        if sid is None:
            return
        del self.sessions[sid]
        self.results.pop(sid, None)
        self.prepared.pop((sid, True), None)
        self.prepared.pop((sid, False), None)
        if peer.role == "worker" and peer.pool is not None:
            ranks = self.workers.get((peer.pool, peer.engine_id), {})
            if ranks.get(peer.rank) is peer:
                del ranks[peer.rank]
        pm = self.pools.get(peer.pool) if peer.pool is not None else None
        if pm is not None and pm.generation == peer.generation:
            pm.sessions -= 1
            if pm.owned.hold(sid, math.inf):
                pm.held_since[sid] = self.now
                self.events["sessions held for a lease"] += 1
        role = peer.role
        peer.session, peer.role, peer.pool, peer.generation = None, "", None, 0
        if role == "worker":
            self._session_gone(sid, certain)
            if not certain and peer.instance:
                self.departed[peer.instance] = sid
                while len(self.departed) > MAX_SESSIONS:
                    del self.departed[next(iter(self.departed))]
        self.finish_resets()


# -- the driver ----------------------------------------------------------------


def holdings(owned: OwnedIndex, owner: int) -> tuple[list[bytes], list[bytes]]:
    """The keys `owner` pins and stores in the model's index (the core keeps them
    private; the driver reads them only to complete them)."""
    pins = owned._pins_of.get(owner)
    return list(pins.elements()) if pins else [], sorted(owned._stores_of.get(owner, ()))


@dataclass(frozen=True)
class Input:
    """One fuzz input: a frame from a peer, or a step the driver resolves when it is sent."""

    peer: str
    frame: bytes | tuple[bytes, ...] = b""  # a tuple is sent as one multipart message
    ack: Ack = "ok"  # how the fake worker answers a job this input starts ("later": not yet)
    done: tuple[int, float, str] = (0, 0.0, "")  # nbytes, seconds, detail of that answer
    oversized: bool = False
    # A JobDone for a live job: the job is the pick-th (modulo) of those not
    # settled when it is sent, else the latest job.
    live: tuple[int, p.JobDone] | None = None
    # (how, copying): a second session takes rank 0 of engine fz on pool fz,
    # with the current worker's instance, with none, with a new one, or with
    # the one its peer had (a process coming back for its jobs); if `copying`,
    # just after the scheduler started a store that it still copies.
    rejoin: tuple[Rejoin, bool] | None = None
    # (verb, n, req_id): a Load (Lookup, LookupPin, PrepareLoad, Touch) of the last n keys
    # learned that are ready in pool fz when it is sent.
    ready: tuple[str, int, int] | None = None
    # (req_id, success): a CompleteLoad of every key the peer's session pinned
    # so far, then a CompleteStore of every key it began to store.
    complete: tuple[int, bool] | None = None


def ready_request(verb: str, rid: int, keys: list[bytes], ids: list[int]) -> p.Request:
    """The request `Input.ready` names; "LookupPin" is a `Lookup` that pins its hits."""
    if verb == "Load":
        return p.Load(rid, keys, ids)
    if verb == "LookupPin":
        return p.Lookup(rid, keys, True)
    request: p.Request = getattr(p, verb)(rid, keys)
    return request


class Fuzz:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.model = Model()
        names = ["fresh", "hello", "rejoin", *HOMES]
        self.peers = {name: Peer(name, self._socket()) for name in names}
        self.peers["worker"].instance = WORKER_INSTANCE
        self.worker_name = "worker"  # the peer playing engine fz's rank 0: worker or rejoin
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

    def peer(self, name: str) -> Peer:
        return self.peers[self.worker_name if name == "worker" else name]

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
        self.model.now = self.count
        if inp.oversized:
            sock = self._socket()  # the transport drops the frame and this peer
            assert isinstance(inp.frame, bytes)
            sock.send(inp.frame)
            self.dropped.append(sock)
            return
        self.home()
        if inp.rejoin is not None:
            how, copying = inp.rejoin
            if copying:
                store = p.Store(self.rid(), [b"copying-%d" % self.count], [self.count % 64])
                self.exchange(self.peers["sched"], p.encoder.encode(store), inp, counted=False)
            self.rejoin(how)
        else:
            frame = inp.frame
            if inp.live is not None:
                pick, msg = inp.live
                live = list(self.model.jobs) or [max(0, self.model.latest_job())]
                frame = p.encoder.encode(
                    msgspec.structs.replace(msg, job_id=live[pick % len(live)])
                )
            elif inp.ready is not None:
                verb, n, rid = inp.ready
                ks = self.model.ready_keys("fz")[-n:]
                ids = [i % 64 for i in range(len(ks))]
                msg = ready_request(verb, rid, ks, ids)
                frame = p.encoder.encode(msg)
            elif inp.complete is not None:
                rid, success = inp.complete
                peer = self.peer(inp.peer)
                ks = self.model.prepared.pop((peer.session or 0, True), [])
                self.exchange(peer, p.encoder.encode(p.CompleteLoad(rid, ks)), inp, True)
                ks = self.model.prepared.pop((peer.session or 0, False), [])
                frame = p.encoder.encode(p.CompleteStore(rid, ks, success))
            self.exchange(self.peer(inp.peer), frame, inp, counted=True)
        if self.count % 500 == 0:
            self.checkpoint()

    def exchange(
        self, peer: Peer, frame: bytes | tuple[bytes, ...], inp: Input | None, counted: bool
    ) -> p.Reply:
        t_send = time.monotonic()
        if isinstance(frame, tuple):
            peer.sock.send_multipart(list(frame))
        else:
            peer.sock.send(frame)
        early: list[p.Reply] = []  # jobs pushed to this very peer come before its reply
        while isinstance(reply := self.receive(peer), p.TransferJob):
            early.append(reply)
        t_recv = time.monotonic()
        if isinstance(reply, p.Error):
            self.codes[reply.code] = self.codes.get(reply.code, 0) + 1
            expect(bool(reply.detail), f"an Error without detail: {reply!r}")
        try:
            req = p.request_decoder.decode(frame) if isinstance(frame, bytes) else None
        except msgspec.ValidationError:  # well-formed msgpack outside the schema
            req = None
            bad_request(reply, envelope_req_id(frame), f"{frame[:200]!r}")
        except msgspec.DecodeError:
            req = None
            bad_request(reply, 0, f"undecodable {frame[:200]!r}")
        if req is None:
            if isinstance(frame, tuple):  # the daemon takes one frame per message
                bad_request(reply, 0, "a multipart message")
            expect(not early, f"pushed {early!r} for a frame it refused")
            return reply
        if counted:
            self.seen.add(type(req))
        try:
            self.model.handle(peer, req, reply)
            self.worker_jobs(peer, early, inp, t_send, t_recv)
        except Mismatch as exc:
            raise Mismatch(f"{peer.name} sent {str(req)[:1500]}: {exc}") from None
        if self.model.poke:
            self.model.poke = False
            self.retry_resets()
        return reply

    def worker_jobs(
        self, sender: Peer, early: list[p.Reply], inp: Input | None, t_send: float, t_recv: float
    ) -> None:
        """The fake worker: receives each job the request started (or moved to the
        sender), checks it, and acknowledges a new one now or leaves it live
        (`Input.ack`). `early`: the jobs pushed to the sender before its reply."""
        for worker, job, rank, again in self.model.take_pushes():
            if worker is sender:
                expect(bool(early), f"job {job.job_id} was not pushed to {worker.name}")
                got = early.pop(0)
            else:
                got = self.receive(worker)
            self.model.pushed(job, rank, again, got, t_send, t_recv)
            ack, (nbytes, seconds, detail) = (inp.ack, inp.done) if inp else ("ok", (0, 0.0, ""))
            if again or ack == "later":
                self.model.events["jobs left live"] += not again
                continue
            done = p.JobDone(self.rid(), job.job_id, rank, ack == "ok", nbytes, seconds, detail)
            self.request(worker, done)
        expect(not early, f"pushed {early!r}, which the model did not expect")

    def retry_resets(self) -> None:
        """Makes the daemon retry its pending resets now: a JobDone for no job (job
        ids start at the daemon's start time in microseconds, never 0) changes
        nothing else."""
        self.model.events["resets retried"] += 1
        impostor = self.peers["impostor"]
        if impostor.session is None or impostor.role != "worker":
            self.home_peer("impostor")
        self.request(impostor, p.JobDone(self.rid(), 0, 0, True, 0, 0.0, ""))

    def request(self, peer: Peer, msg: p.Request) -> p.Reply:
        """A request of the driver itself (homing peers), checked like any input."""
        return self.exchange(peer, p.encoder.encode(msg), None, counted=False)

    def rid(self) -> int:
        self.req_id += 1
        return self.req_id

    def rejoin(self, how: Rejoin) -> None:
        """A second session of engine fz's rank 0 attaches, replacing the current one."""
        now = self.peer("worker")
        other = self.peers["rejoin" if now.name == "worker" else "worker"]
        instance = {
            "same": now.instance,  # a reconnect of the current worker's process
            "none": "",
            "other": f"fz-worker-{self.count}",  # a new process
            "back": other.instance,  # the process this peer last played, if replaced
        }[how]
        self.request(
            other, p.Hello(self.rid(), p.PROTOCOL_VERSION, "worker", "fz", 0, 1, 7, instance)
        )
        self.request(other, p.Attach(self.rid(), "fz", FZ, None))
        if self.model.workers.get(("fz", "fz"), {}).get(0) is other:
            self.worker_name = other.name

    def at_home(self, name: str) -> bool:
        role, engine, pool = HOMES[name]
        peer = self.peer(name)
        pm = self.model.pools.get(pool) if pool else None
        return (
            peer.session is not None
            and (peer.role, peer.engine_id, peer.rank, peer.pool) == (role, engine, 0, pool)
            and (pool is None or (pm is not None and pm.generation == peer.generation))
        )

    def goodbye(self, peer: Peer) -> None:
        """The driver ends a session; what it holds it completes first, or the
        daemon would hold it a lease (and the driver drop its pool)."""
        self.complete_holdings(peer)
        self.request(peer, p.Goodbye(self.rid()))

    def complete_holdings(self, peer: Peer) -> None:
        pm = self.model.pools.get(peer.pool) if peer.pool is not None else None
        if peer.session is None or pm is None or pm.generation != peer.generation:
            return
        pins, stores = holdings(pm.owned, peer.session)
        if pins:
            self.request(peer, p.CompleteLoad(self.rid(), pins))
        if stores:
            self.request(peer, p.CompleteStore(self.rid(), stores, False))

    def home_peer(self, name: str) -> None:
        role, engine, pool = HOMES[name]
        peer = self.peer(name)
        if peer.session is not None:
            self.goodbye(peer)
        # The fz worker whose session ended comes back as the same process, unless
        # it had no instance: then as a new one.
        fz_worker = role == "worker" and pool is not None
        instance = (peer.instance or f"fz-worker-{self.count}") if fz_worker else ""
        self.request(peer, p.Hello(self.rid(), p.PROTOCOL_VERSION, role, engine, 0, 1, 1, instance))
        if pool is not None:
            self.request(peer, p.Attach(self.rid(), pool, FZ, FZ_CAPACITY))

    def home(self) -> None:
        """Puts every peer back in its home state (fuzz inputs can move them), and ends
        what only the daemon's clock would end."""
        fresh = self.peers["fresh"]
        if fresh.session is not None:
            self.goodbye(fresh)
        for name in HOMES:
            if not self.at_home(name):
                self.home_peer(name)
        if self.tidy():
            for name in HOMES:
                if not self.at_home(name):
                    self.home_peer(name)

    def tidy(self) -> bool:
        """Acknowledges jobs live for MAX_AGE inputs; the sessions holding up a reset
        pending that long complete what they hold; a pool whose slots only a lease
        would free is dropped. True if a home peer may have moved."""
        model, admin, token = self.model, self.peers["admin"], self.model.admin_token
        for extra in [n for n in model.pools if n not in ("fz", "fz-b", "fz-c")][:-3]:
            self.request(admin, p.DropPool(self.rid(), extra, token))
        moved = False
        for name, pm in list(model.pools.items()):
            stuck = pm.resetting and model.now - pm.reset_since >= MAX_AGE
            for job in [j for j in model.jobs.values() if j.pool == name]:
                if stuck or model.now - job.born >= MAX_AGE:
                    for rank in job.pending:
                        worker = model.sessions.get(job.pushed_to[rank])
                        if worker is not None and rank not in job.held:
                            self.request(worker, p.JobDone(self.rid(), job.job_id, rank, True))
            if stuck and pm.resetting:  # its sessions complete what they hold
                for owner in pm.owned.owners():
                    peer = model.sessions.get(owner) if isinstance(owner, int) else None
                    if peer is not None:
                        self.complete_holdings(peer)
            held = [since for sid, since in pm.held_since.items() if sid in pm.owned.owners()]
            held += [j.held_since for j in model.jobs.values() if j.pool == name and j.held]
            if (stuck and pm.resetting) or any(model.now - t >= MAX_AGE for t in held):
                self.request(admin, p.DropPool(self.rid(), name, token))
                moved = True
        return moved

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
        self.request(admin, p.CheckInvariants(self.rid(), self.model.admin_token))
        self.request(admin, p.Stats(self.rid()))
        for sock in self.dropped:
            assert not sock.poll(0), "an oversized frame got a reply"
            sock.close()
        self.dropped.clear()
