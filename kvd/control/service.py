"""Runs in the daemon: the request handlers, one per message type (SPEC sections 5 to 7).

Thin by design: validate, call the owned index or the job table, build the
reply. The server feeds frames in and sends what lands in `outbox`; clocks
come in as `now` (seconds), so every rule here is testable without sockets.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import Counter
from collections.abc import Sequence

import msgspec

from kvd.config import Config
from kvd.control.pools import Pool, PoolRegistry
from kvd.control.sessions import Session, SessionTable
from kvd.core.index import OffloadingEvent
from kvd.core.jobs import Job, JobTable, Outcome
from kvd.errors import BadRequest, KvdError, WorkersMissing
from kvd.version import __version__
from kvd_client import protocol as p
from kvd_client.errors import ErrorCode

log = logging.getLogger("kvd.control.service")
POOL_VERBS = (  # the verbs that act on the session's pool
    p.Lookup,
    p.PrepareLoad,
    p.Touch,
    p.CompleteLoad,
    p.PrepareStore,
    p.CompleteStore,
    p.Store,
    p.Load,
)


def check_lengths(keys: Sequence[bytes], ids: Sequence[int]) -> None:
    # Key and id bounds are checked by the schema while decoding; this is not.
    if len(ids) != len(keys):
        raise BadRequest(f"{len(keys)} keys but {len(ids)} device block ids")


# The envelope of a frame: the top-level array, its items left undecoded.
_ENVELOPE = msgspec.msgpack.Decoder(list[msgspec.Raw])


def salvage_req_id(frame: bytes) -> int:
    """The req_id of an undecodable frame when its envelope is intact, else 0.

    Never raises: a frame nested too deep (msgspec's RecursionError) or with a
    non-int req_id (a bool would echo back as a reply no client can decode)
    answers 0.
    """
    try:
        items = _ENVELOPE.decode(frame)
        req_id = msgspec.msgpack.decode(items[1], type=int) if len(items) > 1 else 0
    except (msgspec.DecodeError, RecursionError):
        return 0
    return req_id if 0 <= req_id < 1 << 63 else 0


class Service:
    def __init__(self, config: Config, pools: PoolRegistry, admin_token: str) -> None:
        self.config = config
        self.pools = pools
        # DropPool must carry it: engines share the group that opens the socket,
        # but only the service user and root can read the token's file.
        self._admin_token = admin_token.encode()
        self.sessions = SessionTable(config.lease_ms / 1000)
        self.jobs = JobTable(config.job_timeout_ms / 1000)
        self.counters: Counter[str] = Counter()
        self.requests: Counter[type] = Counter()  # by type: no string work per request
        self.outbox: list[tuple[bytes, bytes]] = []
        # (pool, events) for the publisher; events None = all blocks cleared.
        self.event_outbox: list[tuple[str, list[OffloadingEvent] | None]] = []
        self.last_type: type = p.Error  # type of the request handled last (metrics)
        self.started = time.monotonic()
        self._encode = p.encoder.encode

    # -- entry points ----------------------------------------------------------

    def handle(self, identity: bytes, frame: bytes, now: float) -> None:
        """One frame from one peer; replies go to `outbox`. Never raises."""
        try:
            request = p.request_decoder.decode(frame)
        except msgspec.ValidationError as exc:
            self._error(identity, salvage_req_id(frame), ErrorCode.BAD_REQUEST, str(exc))
            return
        except msgspec.DecodeError as exc:
            self._error(identity, 0, ErrorCode.BAD_REQUEST, f"undecodable frame: {exc}")
            return
        try:
            reply = self._dispatch(identity, request, now)
        except KvdError as exc:
            self._error(identity, request.req_id, exc.code, exc.detail)
            return
        except Exception as exc:  # the server loop must survive any handler bug
            log.exception("event=handler_failed request=%s", type(request).__name__)
            self._error(identity, request.req_id, ErrorCode.INTERNAL, repr(exc))
            return
        if reply is not None:
            self.outbox.append((identity, self._encode(reply)))

    def tick(self, now: float) -> None:
        """Expires leases and jobs; call a few times per lease period."""
        for session in self.sessions.expired(now):
            self.counters["lease_expirations"] += 1
            log.warning(
                "event=lease_expired session=%d role=%s engine=%s rank=%d pid=%d",
                session.session_id,
                session.role,
                session.engine_id,
                session.rank,
                session.pid,
            )
            self._end_session(session)
        self._apply(self.jobs.expire(now))

    def settle(self) -> bool:
        """One step of each pool's idle work (the server calls it once no request
        came for a while); True while more remains."""
        more = False
        for pool in self.pools:
            if pool.index.has_idle_work():
                self.counters["idle_steps"] += 1
                more |= pool.index.settle()
        return more

    def has_idle_work(self) -> bool:
        return any(pool.index.has_idle_work() for pool in self.pools)

    def collect_events(self) -> None:
        """Moves the pools' index events to `event_outbox` (the server publishes them)."""
        for pool in self.pools:
            events = pool.index.take_events()
            if events:
                for event in events:
                    self.counters["evictions" if event.removed else "blocks_stored"] += len(
                        event.keys
                    )
                self.event_outbox.append((pool.name, events))

    def shutdown(self) -> None:
        """Fails every job (settling it) before the pools are unlinked."""
        self._apply(self.jobs.fail_all("daemon shutting down"))

    # -- dispatch --------------------------------------------------------------

    def _dispatch(self, identity: bytes, req: p.Request, now: float) -> p.Reply | None:
        self.requests[type(req)] += 1
        self.last_type = type(req)
        if isinstance(req, p.Hello):
            return self._hello(identity, req, now)
        session = self.sessions.by_identity(identity)
        if session is None:
            raise KvdError("send Hello first", ErrorCode.NOT_HELLO)
        self.sessions.renew(session, now)
        if isinstance(req, POOL_VERBS):
            pool = self._pool_of(session)
            if session.role != "scheduler":
                raise KvdError(
                    f"a {session.role} may not send {type(req).__name__}", ErrorCode.WRONG_ROLE
                )
            return self._pool_verb(session, pool, req, now)
        match req:
            case p.Attach():
                return self._attach(session, req)
            case p.Heartbeat():
                if session.pool is not None:
                    # A session on a dropped pool learns it here, so its client
                    # re-attaches (and a worker remaps) even when idle.
                    self._pool_of(session)
                return p.Ok(req.req_id)
            case p.Finished():
                return p.FinishedResult(req.req_id, self.jobs.take_results(session.session_id))
            case p.JobDone():
                return self._job_done(session, req)
            case p.Stats():
                return self._stats(req)
            case p.Pools():
                return p.PoolsResult(req.req_id, [pool.info() for pool in self.pools])
            case p.DropPool():
                if not hmac.compare_digest(req.token.encode(), self._admin_token):
                    raise KvdError(
                        f"DropPool needs the operator token in {self.config.admin_token_file}, "
                        "which the service user and root can read (`kvd pool drop` sends it)",
                        ErrorCode.WRONG_ROLE,
                    )
                self._drop(req.pool)
                return p.Ok(req.req_id)
            case p.Reset():
                self._reset(req.pool)
                return p.Ok(req.req_id)
            case p.CheckInvariants():
                problems = [
                    f"{pool.name}: {x}"
                    for pool in self.pools
                    for x in pool.index.check_invariants()
                ]
                return p.InvariantsResult(req.req_id, problems)
            case p.Goodbye():
                self._end_session(session)
                return p.Ok(req.req_id)
        raise BadRequest(f"unexpected request {type(req).__name__}")

    def _pool_verb(self, s: Session, pool: Pool, req: p.Request, now: float) -> p.Reply:
        owned, sid = pool.owned, s.session_id
        match req:
            case p.Lookup(req_id, keys):
                hits = owned.index.lookup(keys)
                self.counters["lookups"] += 1
                self.counters["lookup_keys"] += len(keys)
                self.counters["hit_blocks"] += hits or 0
                return p.LookupResult(req_id, hits)
            case p.Touch(req_id, keys):
                owned.index.touch(keys)
                return p.Ok(req_id)
            case p.PrepareLoad(req_id, keys):
                spec = owned.prepare_load(sid, keys, account=sid)
                return p.SlotsResult(req_id, spec.slots)
            case p.CompleteLoad(req_id, keys):
                owned.complete_load(sid, keys)
                return p.Ok(req_id)
            case p.PrepareStore(req_id, keys):
                out = owned.prepare_store(sid, keys)
                if out is None:
                    return p.PrepareStoreResult(req_id, False)
                return p.PrepareStoreResult(
                    req_id, True, out.keys_to_store, out.store_spec.slots, out.evicted_keys
                )
            case p.CompleteStore(req_id, keys, success):
                owned.complete_store(sid, keys, success)
                return p.Ok(req_id)
            case p.Store(req_id, keys, device_ids):
                return self._store(s, pool, req_id, keys, device_ids, now)
            case p.Load(req_id, keys, device_ids):
                return self._load(s, pool, req_id, keys, device_ids, now)
        raise BadRequest(f"unexpected request {type(req).__name__}")

    # -- sessions and pools ----------------------------------------------------

    def _hello(self, identity: bytes, req: p.Hello, now: float) -> p.Reply:
        if req.protocol_version != p.PROTOCOL_VERSION:
            raise KvdError(
                f"protocol version {req.protocol_version} is not spoken here; "
                f"this daemon speaks {p.PROTOCOL_VERSION}",
                ErrorCode.UNSUPPORTED_VERSION,
            )
        if not 1 <= req.world_size <= 1024 or not 0 <= req.rank < req.world_size:
            raise BadRequest(f"rank {req.rank} of world_size {req.world_size} is out of range")
        if len(req.engine_id) > p.MAX_NAME_CHARS:
            raise BadRequest(f"engine_id is longer than {p.MAX_NAME_CHARS} characters")
        old = self.sessions.by_identity(identity)
        if old is not None:
            self._end_session(old)
        if len(self.sessions) >= self.config.max_sessions:
            raise KvdError(
                f"{len(self.sessions)} sessions open; the limit is {self.config.max_sessions}",
                ErrorCode.TOO_LARGE,
            )
        s = self.sessions.open(
            identity, req.role, req.engine_id, req.rank, req.world_size, req.pid, now
        )
        log.info(
            "event=session_opened session=%d role=%s engine=%s rank=%d pid=%d",
            s.session_id,
            s.role,
            s.engine_id,
            s.rank,
            s.pid,
        )
        return p.Welcome(req.req_id, s.session_id, self.config.lease_ms, __version__)

    def stats(self) -> p.StatsResult:
        return self._stats(p.Stats(0))

    def _attach(self, s: Session, req: p.Attach) -> p.Reply:
        if (
            len(req.pool) > p.MAX_NAME_CHARS
            or not req.pool.isascii()  # as in the config: it names a segment and a label
            or not req.pool.replace("-", "").replace("_", "").isalnum()
        ):
            raise BadRequest(f"pool name {req.pool[:64]!r} must be ASCII letters, digits, - and _")
        if s.pool is not None and s.pool != req.pool:
            raise BadRequest(f"this session is attached to pool {s.pool!r}; open another one")
        if s.role == "worker" and s.world_size != req.layout.world_size:
            raise BadRequest(
                f"worker world_size {s.world_size} != layout world_size {req.layout.world_size}"
            )
        created = self.pools.find(req.pool) is None
        pool = self.pools.attach(req.pool, req.layout, req.capacity_bytes)
        if created:  # consumers start this pool's topic from a clean slate
            self.event_outbox.append((pool.name, None))
        if (s.pool, s.generation) != (pool.name, pool.generation):
            pool.sessions += 1  # first attach, or again after the pool was re-created
        s.pool, s.generation = pool.name, pool.generation
        if s.role == "worker":
            replaced = self.sessions.register_worker(s)
            if replaced is not None:
                log.warning(
                    "event=worker_replaced engine=%s rank=%d old_session=%d",
                    s.engine_id,
                    s.rank,
                    replaced.session_id,
                )
                self._end_session(replaced)
        return pool.attached(req.req_id)

    def _pool_of(self, s: Session) -> Pool:
        if s.pool is None:
            raise KvdError("send Attach first", ErrorCode.NOT_ATTACHED)
        pool = self.pools.find(s.pool)
        if pool is None or pool.generation != s.generation:
            raise KvdError(f"pool {s.pool!r} was dropped; attach again", ErrorCode.NO_SUCH_POOL)
        return pool

    def _end_session(self, s: Session) -> None:
        """Rolls a session back: its stores fail, its pins drop, its worker rank goes."""
        self.sessions.close(s)
        self.jobs.forget_session(s.session_id)
        pool = self.pools.find(s.pool) if s.pool is not None else None
        if pool is not None and pool.generation == s.generation:
            pool.sessions -= 1
            stores, refs = pool.owned.release(s.session_id)
            if stores or refs:
                log.info(
                    "event=session_rolled_back session=%d stores_failed=%d refs_dropped=%d",
                    s.session_id,
                    stores,
                    refs,
                )
        if s.role == "worker":
            self._apply(self.jobs.rank_gone(s.engine_id, s.rank))

    def _drop(self, name: str) -> None:
        self.pools.get(name)
        self._apply(self.jobs.fail_all(f"pool {name} dropped", pool=name), apply_index=False)
        self.collect_events()
        self.pools.drop(name)
        self.event_outbox.append((name, None))

    def _reset(self, name: str) -> None:
        pool = self.pools.get(name)
        self._apply(self.jobs.fail_all(f"pool {name} reset", pool=name), apply_index=False)
        self.collect_events()
        pool.owned.reset()
        self.event_outbox.append((name, None))
        log.info("event=pool_reset pool=%s", name)

    # -- transfer jobs ---------------------------------------------------------

    def _ranks(self, s: Session, pool: Pool) -> dict[int, Session]:
        # A worker still on a dropped generation of the pool cannot copy for this one.
        ranks = {
            rank: w
            for rank, w in self.sessions.workers(pool.name, s.engine_id).items()
            if w.generation == pool.generation
        }
        missing = [r for r in range(pool.layout.world_size) if r not in ranks]
        if missing:
            raise WorkersMissing(
                f"engine {s.engine_id!r} has no worker registered on pool "
                f"{pool.name!r} for rank(s) {missing}"
            )
        return ranks

    def _store(
        self,
        s: Session,
        pool: Pool,
        req_id: int,
        keys: list[bytes],
        device_ids: list[int],
        now: float,
    ) -> p.Reply:
        check_lengths(keys, device_ids)
        ranks = self._ranks(s, pool)
        job_id = self.jobs.new_id()
        out = pool.owned.prepare_store(("job", job_id), keys)
        if out is None:
            self.counters["stores_rejected"] += 1
            return p.StoreTicket(req_id, False)
        if not out.keys_to_store:
            return p.StoreTicket(req_id, True, None, [], out.evicted_keys)
        device_of = dict(zip(keys, device_ids, strict=True))
        job_device_ids = [device_of[k] for k in out.keys_to_store]
        writers = frozenset({0}) if pool.layout.replicated else frozenset(ranks)
        job = self._start_job(
            "store", s, pool, ranks, job_id, out.keys_to_store, out.store_spec.slots,
            job_device_ids, writers, now,
        )  # fmt: skip
        self.counters["stores"] += 1
        return p.StoreTicket(req_id, True, job.job_id, out.keys_to_store, out.evicted_keys)

    def _load(
        self,
        s: Session,
        pool: Pool,
        req_id: int,
        keys: list[bytes],
        device_ids: list[int],
        now: float,
    ) -> p.Reply:
        check_lengths(keys, device_ids)
        ranks = self._ranks(s, pool)
        job_id = self.jobs.new_id()
        spec = pool.owned.prepare_load(("job", job_id), keys, account=s.session_id)
        job = self._start_job(
            "load", s, pool, ranks, job_id, list(keys), spec.slots, list(device_ids),
            frozenset(ranks), now,
        )  # fmt: skip
        self.counters["loads"] += 1
        return p.LoadTicket(req_id, job.job_id)

    def _start_job(
        self,
        kind: p.JobKind,
        s: Session,
        pool: Pool,
        ranks: dict[int, Session],
        job_id: int,
        keys: list[bytes],
        slots: list[int],
        device_ids: list[int],
        writers: frozenset[int],
        now: float,
    ) -> Job:
        """Records the job and pushes one `TransferJob` to each rank of the engine."""
        job = self.jobs.create(
            job_id=job_id,
            kind=kind,
            pool=pool.name,
            generation=pool.generation,
            session_id=s.session_id,
            engine_id=s.engine_id,
            keys=keys,
            slots=slots,
            device_block_ids=device_ids,
            ranks=frozenset(ranks),
            writers=writers,
            now=now,
        )
        self._push(job_id, kind, pool, ranks, device_ids, slots, writers)
        return job

    def _push(
        self,
        job_id: int,
        kind: p.JobKind,
        pool: Pool,
        ranks: dict[int, Session],
        device_ids: list[int],
        slots: list[int],
        writers: frozenset[int],
    ) -> None:
        for rank, worker in ranks.items():
            msg = p.TransferJob(
                0, job_id, kind, pool.name, pool.generation, device_ids, slots, rank in writers
            )
            self.outbox.append((worker.identity, self._encode(msg)))

    def _job_done(self, s: Session, req: p.JobDone) -> p.Reply:
        if s.role != "worker":
            raise KvdError("only a worker may send JobDone", ErrorCode.WRONG_ROLE)
        if req.rank != s.rank:
            raise KvdError(f"this session is rank {s.rank}, not {req.rank}", ErrorCode.NOT_OWNER)
        job = self.jobs.get(req.job_id)
        if job is not None and job.engine_id != s.engine_id:
            raise KvdError(f"job {req.job_id} belongs to another engine", ErrorCode.NOT_OWNER)
        outcome = self.jobs.ack(req.job_id, req.rank, req.ok, req.nbytes, req.seconds, req.detail)
        if outcome is not None:
            self._apply([outcome])
            if req.ok:
                self.counters[f"bytes_{outcome.job.kind}d"] += max(0, req.nbytes)
        return p.Ok(req.req_id)

    def _apply(self, outcomes: list[Outcome], apply_index: bool = True) -> None:
        for o in outcomes:
            job = o.job
            if o.report:
                if self.sessions.by_id(job.session_id) is not None:
                    self.jobs.add_result(job.session_id, job.result())
                if not job.ok:
                    self.counters[f"jobs_failed.{job.kind}"] += 1
                    log.warning(
                        "event=job_failed job=%d kind=%s pool=%s reason=%r",
                        job.job_id,
                        job.kind,
                        job.pool,
                        job.failure,
                    )
            if not (o.settle and apply_index):
                continue
            pool = self.pools.find(job.pool)
            if pool is None or pool.generation != job.generation:
                continue
            if job.kind == "store":
                pool.owned.complete_store(job.owner, job.keys, success=job.ok)
            else:
                pool.owned.complete_load(job.owner, job.keys)

    # -- stats -----------------------------------------------------------------

    def _stats(self, req: p.Stats) -> p.StatsResult:
        return p.StatsResult(
            req.req_id,
            daemon_version=__version__,
            uptime_s=time.monotonic() - self.started,
            sessions=len(self.sessions),
            jobs_in_flight=len(self.jobs),
            lease_expirations=self.counters["lease_expirations"],
            max_total_bytes=self.config.max_total_bytes,
            used_bytes=self.pools.used_bytes,
            pools=[pool.info() for pool in self.pools],
            counters={
                **self.counters,
                **{f"requests.{t.__name__}": n for t, n in self.requests.items()},
            },
        )

    def _error(self, identity: bytes, req_id: int, code: str, detail: str) -> None:
        self.counters[f"errors.{code}"] += 1
        self.outbox.append((identity, self._encode(p.Error(req_id, code, detail[:1000]))))
