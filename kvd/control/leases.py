"""Runs in the daemon: sessions from Hello to rollback, and their leases (SPEC section 7).

A session is opened by `Hello` and ended by `Goodbye`, a new `Hello` on the
same socket, its lease running out, or another session taking its worker
rank. However it ends, what it prepared or pinned with the index verbs is
held one more lease, because its engine's own transfer channel may still be
copying. A worker that ended its session itself has stopped copying, so the
jobs it owed settle at once; one whose lease ran out may come back (the same
`Hello.instance`) and take its jobs over.
"""

from __future__ import annotations

import logging

from kvd.config import Config
from kvd.control.admin import PoolAdmin
from kvd.control.pools import PoolRegistry
from kvd.control.sessions import Session, SessionTable
from kvd.control.transfers import Transfers
from kvd.errors import BadRequest, KvdError
from kvd.version import __version__
from kvd_client import protocol as p
from kvd_client.errors import ErrorCode

log = logging.getLogger("kvd.control.leases")


class Leases:
    def __init__(
        self,
        config: Config,
        pools: PoolRegistry,
        sessions: SessionTable,
        transfers: Transfers,
        admin: PoolAdmin,
    ) -> None:
        self._config = config
        self._pools = pools
        self._sessions = sessions
        self._transfers = transfers
        self._admin = admin
        # Worker sessions that ended without saying so, by client instance.
        self._departed: dict[str, int] = {}

    def hello(self, identity: bytes, req: p.Hello, now: float) -> p.Reply:
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
        old = self._sessions.by_identity(identity)
        if old is not None:  # the client itself starts over, as after a Goodbye
            self.end(old, now, certain=True)
        if len(self._sessions) >= self._config.max_sessions:
            raise KvdError(
                f"{len(self._sessions)} sessions open; the limit is {self._config.max_sessions}",
                ErrorCode.TOO_LARGE,
            )
        s = self._sessions.open(
            identity, req.role, req.engine_id, req.rank, req.world_size, req.pid, now, req.instance
        )
        log.info(
            "event=session_opened session=%d role=%s engine=%s rank=%d pid=%d",
            s.session_id, s.role, s.engine_id, s.rank, s.pid,
        )  # fmt: skip
        return p.Welcome(req.req_id, s.session_id, self._config.lease_ms, __version__)

    def end(self, s: Session, now: float, certain: bool) -> None:
        """Rolls a session back: its stores fail, its pins drop, its worker rank goes.

        What it prepared or pinned with the index verbs is held one more lease
        (its engine may still be copying). `certain`: a worker that ended its
        session itself (Goodbye, a new Hello) has stopped copying, so the jobs
        it owed settle now; otherwise one lease later, unless its process
        comes back (`Hello.instance`) and takes them over.
        """
        self._sessions.close(s)
        self._transfers.forget_session(s.session_id)
        pool = self._pools.find(s.pool) if s.pool is not None else None
        if pool is not None and pool.generation == s.generation:
            pool.sessions -= 1
            # Its engine's own transfer channel may still copy into what it
            # prepared, however the session ended: one lease of grace.
            self._admin.release(pool, s.session_id, now + self._sessions.lease_s, now)
        if s.role == "worker":
            self._transfers.session_gone(s.session_id, certain, now, self._sessions.lease_s)
            if not certain and s.instance:  # its process may come back and answer
                self._departed[s.instance] = s.session_id
                while len(self._departed) > self._config.max_sessions:
                    del self._departed[next(iter(self._departed))]
        self._admin.finish_resets()

    def attached(self, s: Session, replaced: Session | None, now: float) -> None:
        """`s` attached, and took over worker rank of `replaced` (if any). A reconnect
        of the same worker process (the same instance) takes over its jobs, whether
        the old session is still registered or its lease already ran out."""
        if replaced is not None:
            same = bool(s.instance) and replaced.instance == s.instance
            if same:
                self._transfers.rebind(replaced.session_id, s)  # before they could fail
            self.end(replaced, now, certain=False)
            if same:
                self._departed.pop(s.instance, None)
        old = self._departed.pop(s.instance, None) if s.instance else None
        if old is not None and s.role == "worker":
            self._transfers.rebind(old, s)
