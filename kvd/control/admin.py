"""Runs in the daemon: pool administration, from `Attach` to `DropPool` (SPEC sections 3 and 11).

`PoolAdmin` attaches sessions to pools (creating a pool on first use), drops
pools (failing their jobs; the segment goes away), resets them once nothing
copies into them, answers `Pools` and `CheckInvariants`, and moves the
pools' index events to the publisher's outbox. Only the operator token opens
`DropPool`, `CheckInvariants` and another's `Reset`: engines share the group
that opens the socket, but only the service user and root can read the
token's file.
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from kvd.control.pools import Pool, PoolRegistry
from kvd.control.sessions import Session, SessionTable
from kvd.control.transfers import Transfers
from kvd.core.index import OffloadingEvent
from kvd.errors import BadRequest, KvdError
from kvd_client import protocol as p
from kvd_client.errors import ErrorCode

log = logging.getLogger("kvd.control.admin")
# (pool, events, the pool's layout's groups) for the publisher; events None =
# all blocks cleared. The groups go with the events, taken when they were: a
# pool dropped and made again under its name before they went out may name
# other groups.
EventOutbox = list[tuple[str, list[OffloadingEvent] | None, tuple[p.Group, ...]]]


class PoolAdmin:
    def __init__(
        self,
        pools: PoolRegistry,
        sessions: SessionTable,
        transfers: Transfers,
        counters: Counter[str],
        admin_token: str,
        admin_token_file: Path,
    ) -> None:
        self.pools = pools
        self._sessions = sessions
        self._transfers = transfers
        self._counters = counters
        self._admin_token = admin_token.encode()
        self._admin_token_file = admin_token_file
        self.event_outbox: EventOutbox = []
        self.on_reset: Callable[[Pool], None] | None = None  # the disk tier's, when there is one

    def attach_later(
        self, s: Session, req: p.Attach, answer: Callable[[KvdError | None], None]
    ) -> bool:
        """True when `req` names a pool not made yet, which is now built off the loop
        (`kvd.control.pool_builds`, or joined while it is): `answer` runs on the
        loop once it is there (None) or could not be made (why), to `attach`.
        False: `attach` answers now (the pool is there, or no thread builds)."""
        builds = self.pools.builds
        if builds.post is None or self.pools.find(req.pool) is not None:
            return False
        self._check_attach(s, req)
        if builds.join(req.pool, req.layout, answer):
            return True
        planned = self.pools.plan(req.pool, req.layout, req.capacity_bytes,
                                  self.pools.config.policy)  # fmt: skip

        def first(error: KvdError | None) -> None:
            if error is None:  # consumers start this pool's topic from a clean slate
                self.event_outbox.append((planned.name, None, ()))
            answer(error)

        builds.start(planned, first)
        return True

    def attach(self, s: Session, req: p.Attach) -> tuple[p.Reply, Session | None]:
        """Attaches `s`; the reply, and a worker session this one replaced (to end)."""
        self._check_attach(s, req)
        created = self.pools.find(req.pool) is None
        pool = self.pools.attach(req.pool, req.layout, req.capacity_bytes)
        if created:  # consumers start this pool's topic from a clean slate
            self.event_outbox.append((pool.name, None, ()))
        if (s.pool, s.generation) != (pool.name, pool.generation):
            pool.sessions += 1  # first attach, or again after the pool was re-created
        s.pool, s.generation = pool.name, pool.generation
        replaced = None
        if s.role == "worker":
            replaced = self._sessions.register_worker(s)
            if replaced is not None:
                log.warning(
                    "event=worker_replaced engine=%s rank=%d old_session=%d",
                    s.engine_id,
                    s.rank,
                    replaced.session_id,
                )
        return pool.attached(req.req_id), replaced

    @staticmethod
    def _check_attach(s: Session, req: p.Attach) -> None:
        if not p.valid_pool_name(req.pool):
            raise BadRequest(f"pool name {req.pool[:64]!r} must be ASCII letters, digits, - and _")
        if s.pool is not None and s.pool != req.pool:
            raise BadRequest(f"this session is attached to pool {s.pool!r}; open another one")
        if s.role == "worker" and s.world_size != req.layout.world_size:
            raise BadRequest(
                f"worker world_size {s.world_size} != layout world_size {req.layout.world_size}"
            )

    def pool_of(self, s: Session) -> Pool:
        """The pool `s` is attached to; `NO_SUCH_POOL` once it was dropped."""
        if s.pool is None:
            raise KvdError("send Attach first", ErrorCode.NOT_ATTACHED)
        pool = self.pools.find(s.pool)
        if pool is None or pool.generation != s.generation:
            raise KvdError(f"pool {s.pool!r} was dropped; attach again", ErrorCode.NO_SUCH_POOL)
        return pool

    def _operator(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self._admin_token)

    def _need_operator(self, token: str, what: str) -> None:
        if not self._operator(token):
            raise KvdError(
                f"{what} needs the operator token in {self._admin_token_file}, "
                "which the service user and root can read (`kvd pool drop` sends it)",
                ErrorCode.WRONG_ROLE,
            )

    def drop(self, req: p.DropPool) -> p.Reply:
        self._need_operator(req.token, "DropPool")
        self.pools.get(req.pool)
        self._transfers.fail_all(f"pool {req.pool} dropped", pool=req.pool)
        self.collect_events()
        self.pools.drop(req.pool, disk=True)
        self.event_outbox.append((req.pool, None, ()))
        return p.Ok(req.req_id)

    def reset(self, s: Session, req: p.Reset) -> p.Reply:
        """Empties a pool, for the operator or a session attached to it.

        The pool's jobs fail now, and from now on it serves no hit and takes no
        new transfer; the blocks go once nothing copies into or out of its
        slots any more (its jobs settled, its sessions' pins and stores
        completed or rolled back), so no slot is reused under a copy. Its
        segment's slot table says they are gone before the reply
        (`SlotTable.begin_reset`), so a warm restart never brings them back.
        """
        pool = self.pools.get(req.pool)
        attached = s.pool == pool.name and s.generation == pool.generation
        if not ((attached and s.role == "scheduler") or self._operator(req.token)):
            raise KvdError(
                f"Reset of pool {req.pool!r} needs the operator token in "
                f"{self._admin_token_file}, or a scheduler attached to that pool",
                ErrorCode.WRONG_ROLE,
            )
        if not pool.resetting:
            pool.resetting = True
            if pool.table is not None:  # no hit from the table either, from now on
                pool.table.begin_reset()
            if self.on_reset is not None:  # the disk tier's reads end; its entries go
                self.on_reset(pool)
            log.info("event=pool_reset_started pool=%s", req.pool)
        self._transfers.fail_pool(req.pool, f"pool {req.pool} reset")
        self.finish_resets()
        if pool.resetting:  # acknowledged now: a warm restart must not bring them back
            pool.region.table.begin_reset()
        return p.Ok(req.req_id)

    @staticmethod
    def while_resetting(pool: Pool, req: p.Request) -> p.Reply | None:
        """The answer of a pool being reset: no hits, no new transfers; None for the
        completions, which drain it as usual."""
        if not pool.resetting or isinstance(req, p.CompleteLoad | p.CompleteStore):
            return None
        match req:
            case p.Lookup(req_id):
                return p.LookupResult(req_id, 0)
            case p.Touch(req_id) | p.Observe(req_id):
                return p.Ok(req_id)
            case p.PrepareStore(req_id):
                return p.PrepareStoreResult(req_id, False)
            case p.Store(req_id):
                return p.StoreTicket(req_id, False)
        raise KvdError(f"pool {pool.name!r} is being reset", ErrorCode.MISSING)

    def finish_resets(self) -> None:
        """Completes every pending reset whose pool no longer has a copy in flight."""
        for pool in self.pools:
            if (
                pool.resetting
                and not self._transfers.num_unsettled(pool.name)
                and not pool.owned.owners()
            ):
                self.collect_events()
                pool.owned.reset()
                if pool.disk is not None:
                    pool.disk.finish_reset()
                pool.resetting = False
                self.event_outbox.append((pool.name, None, ()))
                log.info("event=pool_reset pool=%s", pool.name)

    def pools_result(self, req: p.Pools) -> p.Reply:
        return p.PoolsResult(req.req_id, [pool.info() for pool in self.pools])

    def invariants(self, req: p.CheckInvariants) -> p.Reply:
        # Operator only: it walks every block of every pool on the event loop.
        self._need_operator(req.token, "CheckInvariants")
        problems = [
            f"{pool.name}: {x}" for pool in self.pools for x in pool.index.check_invariants()
        ] + [
            f"{pool.name} (disk): {x}"
            for pool in self.pools
            if pool.disk is not None
            for x in pool.disk.index.check_invariants()
        ]
        return p.InvariantsResult(req.req_id, problems)

    def drop_unbacked(self) -> None:
        """Drops each pool whose pages could not all be allocated (the shared-memory
        filesystem filled up under its prefault): its sessions re-attach to a new one."""
        for pool in self.pools:
            reason = pool.region.prefault_error
            if reason is not None:
                log.error("event=pool_unbacked pool=%s reason=%r", pool.name, reason)
                self._transfers.fail_all(f"pool {pool.name} could not be backed", pool=pool.name)
                self.collect_events()
                self.pools.drop(pool.name)
                self.event_outbox.append((pool.name, None, ()))

    def release(self, pool: Pool, owner: int, until: float, now: float) -> None:
        """Rolls session `owner` back on `pool` now, or holds its slots until `until`."""
        if until > now:
            if pool.owned.hold(owner, until):
                log.info("event=session_held session=%d pool=%s until_s=%.1f", owner, pool.name,
                         until - now)  # fmt: skip
            return
        self._log_rollback(owner, *pool.owned.release(owner))

    def release_due(self, now: float) -> None:
        """Rolls back the held sessions whose time came, frees the slots a warm
        start held (SPEC 13) once the dead daemon's jobs are past their hard
        deadlines; finishes resets that can."""
        for pool in self.pools:
            for owner, stores, refs in pool.owned.release_due(now):
                self._log_rollback(owner, stores, refs)
            if pool.held_until and now >= pool.held_until:
                pool.held_until = 0.0
                log.info("event=held_slots_released pool=%s slots=%d", pool.name,
                         pool.index.release_held())  # fmt: skip
        self.finish_resets()

    @staticmethod
    def _log_rollback(owner: object, stores: int, refs: int) -> None:
        if stores or refs:
            log.info(
                "event=session_rolled_back session=%s stores_failed=%d refs_dropped=%d",
                owner,
                stores,
                refs,
            )

    def collect_events(self) -> None:
        """Moves the pools' index events (their disk indexes' too, medium STORAGE)
        to `event_outbox` (the server publishes them)."""
        for pool in self.pools:
            events = pool.index.take_events()
            for event in events:
                self._counters["evictions" if event.removed else "blocks_stored"] += len(event.keys)
            if pool.disk is not None:
                events += pool.disk.index.take_events()
            if events:
                self.event_outbox.append((pool.name, events, pool.layout.groups))

    def announce_cleared(self) -> None:
        """Every pool's topic starts over (daemon shutdown)."""
        for pool in self.pools:
            self.event_outbox.append((pool.name, None, ()))
