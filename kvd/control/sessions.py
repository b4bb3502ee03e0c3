"""Runs in the daemon: client sessions, their leases, and the registered workers.

A session is one ZeroMQ peer (its routing identity) after `Hello`. Any message
renews its lease; a session whose lease passes is rolled back by the server.
Time is passed in (`now`, seconds).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvd_client.protocol import Role


@dataclass
class Session:
    session_id: int
    identity: bytes
    role: Role
    engine_id: str
    rank: int
    world_size: int
    pid: int
    expires: float
    pool: str | None = None
    generation: int = 0
    instance: str = ""  # the client process's own id (`Hello.instance`)


class SessionTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._by_identity: dict[bytes, Session] = {}
        self._by_id: dict[int, Session] = {}
        self._workers: dict[tuple[str, str], dict[int, Session]] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_id.values()))

    def open(
        self,
        identity: bytes,
        role: Role,
        engine_id: str,
        rank: int,
        world_size: int,
        pid: int,
        now: float,
        instance: str = "",
    ) -> Session:
        session = Session(
            self._next_id, identity, role, engine_id, rank, world_size, pid, now + self.lease_s,
            instance=instance,
        )  # fmt: skip
        self._next_id += 1
        self._by_identity[identity] = session
        self._by_id[session.session_id] = session
        return session

    def by_identity(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def by_id(self, session_id: int) -> Session | None:
        return self._by_id.get(session_id)

    def renew(self, session: Session, now: float) -> None:
        session.expires = now + self.lease_s

    def register_worker(self, session: Session) -> Session | None:
        """Registers `session` as its engine's rank on its pool; returns a replaced one."""
        assert session.pool is not None
        ranks = self._workers.setdefault((session.pool, session.engine_id), {})
        old = ranks.get(session.rank)
        ranks[session.rank] = session
        return old if old is not session else None

    def workers(self, pool: str, engine_id: str) -> dict[int, Session]:
        return self._workers.get((pool, engine_id), {})

    def close(self, session: Session) -> None:
        self._by_identity.pop(session.identity, None)
        self._by_id.pop(session.session_id, None)
        if session.role == "worker" and session.pool is not None:
            ranks = self._workers.get((session.pool, session.engine_id))
            if ranks is not None and ranks.get(session.rank) is session:
                del ranks[session.rank]
                if not ranks:
                    del self._workers[(session.pool, session.engine_id)]

    def expired(self, now: float) -> list[Session]:
        return [s for s in self._by_id.values() if s.expires <= now]
