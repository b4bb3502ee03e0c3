"""Runs in the daemon: request dispatch, sessions and their leases (SPEC sections 6 and 7).

`Service.handle` decodes one frame, finds its session, and hands the request
to the object that owns its concern: the pool's index for the index verbs,
`Transfers` for jobs, `PoolAdmin` for pools, `Stats` for counters. The
server feeds frames in and sends what lands in `outbox`; clocks come in as
`now` (seconds), so every rule here is testable without sockets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import msgspec

from kvd.config import Config
from kvd.control.admin import PoolAdmin
from kvd.control.disk import DiskTier
from kvd.control.leases import Leases
from kvd.control.observed import ObservedLookups, check_observe, oversized
from kvd.control.pools import Pool, PoolRegistry
from kvd.control.remote import RemoteTier
from kvd.control.sessions import Session, SessionTable
from kvd.control.stats import Stats
from kvd.control.transfers import Transfers
from kvd.core.index import BlockIndex
from kvd.errors import BadRequest, KvdError
from kvd_client import protocol as p
from kvd_client.errors import ErrorCode

log = logging.getLogger("kvd.control.service")
POOL_VERBS = (  # the verbs that act on the session's pool
    p.Lookup,
    p.Observe,
    p.PrepareLoad,
    p.Touch,
    p.CompleteLoad,
    p.PrepareStore,
    p.CompleteStore,
    p.Store,
    p.Load,
)


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
        self.sessions = SessionTable(config.lease_ms / 1000)
        self.statistics = Stats()
        self.counters = self.statistics.counters
        self.outbox: list[tuple[bytes, bytes]] = []
        self._encode = p.encoder.encode
        self.transfers = Transfers(
            config.job_timeout_ms / 1000,
            pools,
            self.sessions,
            self.counters,
            self.outbox,
            self._encode,
            config.max_pending_results,
            first_job_id=time.time_ns() // 1000,  # ids never repeat across restarts
        )
        self.admin = PoolAdmin(
            pools,
            self.sessions,
            self.transfers,
            self.counters,
            admin_token,
            config.admin_token_file,
        )
        self.event_outbox = self.admin.event_outbox  # what the server publishes
        self.leases = Leases(config, pools, self.sessions, self.transfers, self.admin)
        self.last_type: type = p.Error  # type of the request handled last (metrics)
        self.observed = ObservedLookups(pools, self.counters)  # the server applies them
        self.remote: RemoteTier | None = None  # with remote_url (`start_tiers`)
        self.disk: DiskTier | None = None  # with disk_dir (`start_tiers`)

    # -- entry points ----------------------------------------------------------

    def handle(self, identity: bytes, frame: bytes, now: float) -> None:
        """One frame from one peer; replies go to `outbox`. Never raises."""
        if (too_big := oversized(frame)) is not None:  # refused before a whole decode
            self._renew_sender(identity, now)
            self._error(identity, too_big[0], ErrorCode.BAD_REQUEST, too_big[1])
            return
        try:
            request = p.request_decoder.decode(frame)
        except msgspec.ValidationError as exc:
            self._renew_sender(identity, now)
            self._error(identity, salvage_req_id(frame), ErrorCode.BAD_REQUEST, str(exc))
            return
        except msgspec.DecodeError as exc:
            self._renew_sender(identity, now)
            self._error(identity, 0, ErrorCode.BAD_REQUEST, f"undecodable frame: {exc}")
            return
        try:
            reply = self._dispatch(identity, request, now)
            if reply is not None:  # encoding is inside the boundary too
                self.outbox.append((identity, self._encode(reply)))
        except KvdError as exc:
            self._error(identity, request.req_id, exc.code, exc.detail)
        except Exception as exc:  # the server loop must survive any handler bug
            log.exception("event=handler_failed request=%s", type(request).__name__)
            self._error(identity, request.req_id, ErrorCode.INTERNAL, repr(exc))

    def _renew_sender(self, identity: bytes, now: float) -> None:
        """Any message renews its session's lease (SPEC 7), an undecodable one too:
        its sender is alive."""
        session = self.sessions.by_identity(identity)
        if session is not None:
            self.sessions.renew(session, now)

    def tick(self, now: float) -> None:
        """Expires leases and jobs; call a few times per lease period."""
        for session in self.sessions.expired(now):
            self.counters["lease_expirations"] += 1
            log.warning(
                "event=lease_expired session=%d role=%s engine=%s rank=%d pid=%d",
                session.session_id, session.role, session.engine_id, session.rank, session.pid,
            )  # fmt: skip
            self.leases.end(session, now, certain=False)
        self.transfers.expire(now)
        if self.remote is not None:
            self.remote.tick(now)
        if self.disk is not None:
            self.disk.tick(now)
        self.admin.release_due(now)
        self.admin.drop_unbacked()
        for pool in self.pools:  # readers take a table not written lately as dead
            if pool.table is not None:
                pool.table.beat()

    # -- the tiers below RAM -----------------------------------------------------

    def start_tiers(self, post: Callable[[Callable[[], None]], object]) -> None:
        """The disk and remote tiers the config names; `post` hands a thread's
        result to the loop (its call_soon_threadsafe)."""
        if self.config.remote_url:
            self.remote = RemoteTier.start(self.config, self.pools, self.counters, post)
        if self.config.disk_dir:
            self.disk = DiskTier(self.config, self.pools, self.counters, post)
            self.admin.on_reset = self.disk.begin_reset

    def pump_tiers(self) -> None:
        """Hands the blocks that became ready since the last call to the tiers'
        write-behinds: stored ones to both, fetched from the remote to the disk."""
        for pool in self.pools:
            tap = pool.tap
            if tap is None or not (tap.keys or tap.fetched):
                continue
            keys, fetched = tap.take()
            if self.remote is not None:
                self.remote.write_ready(pool, keys)
            if self.disk is not None:
                self.disk.write_ready(pool, keys + fetched)

    def close_tiers(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            self.disk.close()

    def _below(self, pool: Pool, keys: list[bytes], hits: int, now: float) -> int | None:
        """RAM missed at keys[hits]: the disk tier, then the remote tier (None: they
        read the rest meanwhile, ask again)."""
        if self.disk is not None and self.disk.lookup(pool, keys, hits, now) is None:
            return None
        if self.remote is not None:
            return self.remote.lookup(pool, keys, hits, now)
        return hits

    def settle(self) -> bool:
        """One step of each pool's idle work (the server calls it once no request
        came for a while); True while more remains."""
        more = False
        for index in self._indexes():
            if index.has_idle_work():
                self.counters["idle_steps"] += 1
                more |= index.settle()
        return more

    def has_idle_work(self) -> bool:
        return any(index.has_idle_work() for index in self._indexes())

    def _indexes(self) -> Iterator[BlockIndex]:
        """Every pool's index, and its disk index (which learns its adopted blocks
        in slices too)."""
        for pool in self.pools:
            yield pool.index
            if pool.disk is not None:
                yield pool.disk.index

    def collect_events(self) -> None:
        """Moves the pools' index events to `event_outbox` (the server publishes them)."""
        self.admin.collect_events()

    def shutdown(self) -> None:
        """Fails every job (settling it) before the pools are unlinked."""
        self.transfers.fail_all("daemon shutting down")

    def stats(self) -> p.StatsResult:
        return self._stats(p.Stats(0))

    # -- dispatch --------------------------------------------------------------

    def _dispatch(self, identity: bytes, req: p.Request, now: float) -> p.Reply | None:
        self.statistics.requests[type(req)] += 1
        self.last_type = type(req)
        if isinstance(req, p.Hello):
            return self.leases.hello(identity, req, now)
        session = self.sessions.by_identity(identity)
        if session is None:
            raise KvdError("send Hello first", ErrorCode.NOT_HELLO)
        self.sessions.renew(session, now)
        if isinstance(req, POOL_VERBS):
            pool = self.admin.pool_of(session)
            if session.role != "scheduler":
                raise KvdError(
                    f"a {session.role} may not send {type(req).__name__}", ErrorCode.WRONG_ROLE
                )
            return self._pool_verb(session, pool, req, now)
        match req:
            case p.Attach():
                later = lambda error: self._attach_built(session, req, error)  # noqa: E731
                if self.admin.attach_later(session, req, later):
                    return None  # a new pool, built off the loop: answered once it is
                reply, replaced = self.admin.attach(session, req)
                self.leases.attached(session, replaced, now)
                return reply
            case p.Heartbeat():
                if session.pool is not None:
                    # A session on a dropped pool learns it here, so its client
                    # re-attaches (and a worker remaps) even when idle.
                    self.admin.pool_of(session)
                return p.Ok(req.req_id)
            case p.Finished():
                return p.FinishedResult(req.req_id, self.transfers.take_results(session.session_id))
            case p.JobDone():
                reply = self.transfers.job_done(session, req)
                self.admin.finish_resets()
                return reply
            case p.Stats():
                return self._stats(req)
            case p.Pools():
                return self.admin.pools_result(req)
            case p.DropPool():
                return self.admin.drop(req)
            case p.Reset():
                return self.admin.reset(session, req)
            case p.CheckInvariants():
                return self.admin.invariants(req)
            case p.Goodbye():
                # A client says goodbye once its copies have stopped.
                self.leases.end(session, now, certain=True)
                return p.Ok(req.req_id)
        raise BadRequest(f"unexpected request {type(req).__name__}")

    def _pool_verb(self, s: Session, pool: Pool, req: p.Request, now: float) -> p.Reply:
        owned, sid = pool.owned, s.session_id
        refused = self.admin.while_resetting(pool, req)
        if refused is not None:
            if isinstance(req, p.Observe):
                check_observe(req)  # a bad one is refused then too
            return refused
        match req:
            case p.Lookup(req_id, keys, pin):
                hits = owned.index.lookup(keys)
                if hits is not None and hits < len(keys) and pool.tap is not None:
                    hits = self._below(pool, keys, hits, now)
                self.counters["lookups"] += 1
                self.counters["lookup_keys"] += len(keys)
                self.counters["hit_blocks"] += hits or 0
                if not (pin and hits):
                    return p.LookupResult(req_id, hits)
                spec = owned.prepare_load(sid, keys[:hits], account=sid)
                self.counters["loaded_blocks"] += hits
                return p.LookupResult(req_id, hits, spec.slots)
            case p.Observe(req_id):  # answered from the ready table: checked, counted,
                self.observed.add(pool, req)  # and queued for the policy (observed.py)
                return p.Ok(req_id)
            case p.Touch(req_id, keys):
                owned.index.touch(keys)
                return p.Ok(req_id)
            case p.PrepareLoad(req_id, keys):
                spec = owned.prepare_load(sid, keys, account=sid)
                self.counters["loaded_blocks"] += len(keys)
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
                return self.transfers.store(s, pool, req_id, keys, device_ids, now)
            case p.Load(req_id, keys, device_ids):
                return self.transfers.load(s, pool, req_id, keys, device_ids, now)
        raise BadRequest(f"unexpected request {type(req).__name__}")

    def _attach_built(self, s: Session, req: p.Attach, error: KvdError | None) -> None:
        """An Attach that waited for its new pool (`PoolAdmin.attach_later`), answered
        on the loop once the pool is there; the server sends `outbox`."""
        if self.sessions.by_id(s.session_id) is not s:
            return  # the session ended meanwhile
        try:
            if error is not None:
                raise error
            reply, replaced = self.admin.attach(s, req)
            self.leases.attached(s, replaced, time.monotonic())
            self.outbox.append((s.identity, self._encode(reply)))
        except KvdError as exc:
            self._error(s.identity, req.req_id, exc.code, exc.detail)
        except Exception as exc:  # the loop must survive any bug here too
            log.exception("event=handler_failed request=Attach")
            self._error(s.identity, req.req_id, ErrorCode.INTERNAL, repr(exc))

    # -- replies ---------------------------------------------------------------

    def _stats(self, req: p.Stats) -> p.StatsResult:
        return self.statistics.result(
            req.req_id,
            sessions=len(self.sessions),
            jobs_in_flight=len(self.transfers),
            max_total_bytes=self.config.max_total_bytes,
            pools=self.pools,
        )

    def _error(self, identity: bytes, req_id: int, code: str, detail: str) -> None:
        self.counters[f"errors.{code}"] += 1
        self.outbox.append((identity, self._encode(p.Error(req_id, code, detail[:1000]))))
