"""Runs in the daemon, on the remote tier's threads: the connection to Redis or Valkey (SPEC 14).

`RemoteStore` is one redis-py client (hiredis parses the replies), standalone
or cluster as `remote_url` says, used by one thread only. Every call is one
pipelined round trip (per node, on a cluster) bounded by `remote_timeout_ms`;
redis-py's own retries are off, so a call that fails fails within its
timeout and the caller counts it. A client that failed is thrown away; the
next call after the backoff (doubling from 50 ms to 2 s) connects afresh,
which on a cluster also reads the slot map again (a failover moves slots).
`Link` holds whether the tier is up, for the event loop to read; it logs a
change of state once, never once per request.

`RemoteThread` runs the calls given to it, in order, on a thread of its own,
and hands each result to the event loop (`post`, the loop's
`call_soon_threadsafe`): the loop never waits on the remote tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvd.config import RemoteTarget

log = logging.getLogger("kvd.io.remote_store")
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0


class RemoteError(Exception):
    """A remote call failed; the message says why (never with credentials)."""


class RemoteDown(RemoteError):
    """The remote tier cannot be reached now (connecting, backing off, a
    connection or cluster error): the link goes down and the client is renewed."""


class RemoteRefused(RemoteError):
    """The server answered the call with an error (OOM under `noeviction`, a
    wrong type, ...): that call failed; the link stays up."""


def _is_down(exc: BaseException) -> bool:
    """Whether `exc` says the connection (or the cluster's slot map) is bad,
    rather than that the server refused one command."""
    import redis.exceptions as rx

    if isinstance(exc, rx.ConnectionError | rx.TimeoutError | OSError):
        return True
    down = tuple(
        getattr(rx, name)
        for name in ("ClusterError", "ClusterDownError", "SlotNotCoveredError",
                     "MasterDownError", "TryAgainError", "MovedError", "AskError")
        if hasattr(rx, name)
    )  # fmt: skip
    return isinstance(exc, down) or not isinstance(exc, rx.ResponseError)


def describe(exc: BaseException) -> str:
    """One line for the log: redis-py 8's repr of its errors names only a category."""
    return f"{type(exc).__name__}: {exc}"[:200]


class Link:
    """Whether the remote tier answers, as the threads last saw it."""

    def __init__(self, where: str) -> None:
        self.where = where  # for the log: hosts only, never credentials
        self.up = False
        self.changes = 0
        self._lock = threading.Lock()
        self._logged: bool | None = None

    def saw(self, up: bool, reason: str = "") -> None:
        with self._lock:
            self.up = up
            if self._logged == up:
                return
            self._logged = up
            self.changes += 1
        if up:
            log.info("event=remote_up remote=%s", self.where)
        else:
            log.warning("event=remote_down remote=%s reason=%s", self.where, reason)


class RemoteStore:
    def __init__(self, target: RemoteTarget, timeout_s: float, link: Link) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.link = link
        self._client: Any = None
        self._backoff = 0.0
        self._next_try = 0.0
        self._attempts = 0

    def _connect(self) -> Any:
        now = time.monotonic()
        if now < self._next_try:
            raise RemoteDown("backing off after an error")
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        t = self.target
        common: dict[str, Any] = {
            "socket_timeout": self.timeout_s,
            "socket_connect_timeout": self.timeout_s,
            # Replies are blocks of 256 KiB and more: read them in big pieces
            # (redis-py's default is 32 KiB a read).
            "socket_read_size": 1 << 20,
            "retry": Retry(NoBackoff(), 0),
            "username": t.username,
            "password": t.password,
            "ssl": t.tls,
        }
        try:
            if t.cluster:
                from redis.cluster import ClusterNode, RedisCluster

                # Each attempt starts from the next node: redis-py asks its first
                # startup node for the command table, so a dead first node would
                # fail every attempt.
                self._attempts += 1
                i = self._attempts % len(t.nodes)
                nodes = [ClusterNode(h, p) for h, p in t.nodes[i:] + t.nodes[:i]]  # type: ignore[no-untyped-call]
                client: Any = RedisCluster(startup_nodes=nodes, **common)
            else:
                (host, port), = t.nodes  # fmt: skip
                client = redis.Redis(host=host, port=port, db=t.db, **common)
                client.ping()
        except Exception as exc:
            self._failed(exc)
            raise RemoteDown(str(exc)) from exc
        self._client = client
        self._backoff = 0.0
        self.link.saw(True)
        return client

    def _failed(self, exc: BaseException) -> None:
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff * 2))
        self._next_try = time.monotonic() + self._backoff
        if self._client is not None:
            try:
                self._client.close()
            except Exception as close_exc:  # a broken client may fail to close too
                log.debug("event=remote_close_failed reason=%r", close_exc)
            self._client = None
        self.link.saw(False, describe(exc))

    def _run(self, build: Callable[[Any], None]) -> list[Any]:
        client = self._client if self._client is not None else self._connect()
        try:
            pipe = client.pipeline(transaction=False)
            build(pipe)
            out: list[Any] = pipe.execute(raise_on_error=True)
        except Exception as exc:
            self._raise(exc)
        return out

    def _raise(self, exc: Exception) -> NoReturn:
        if _is_down(exc):
            self._failed(exc)
            raise RemoteDown(describe(exc)) from exc
        raise RemoteRefused(describe(exc)) from exc

    def ping(self) -> None:
        """Connects if need be (after the backoff) and checks the store answers;
        the link is up after it (the other thread's failure may have set it down)."""
        client = self._client if self._client is not None else self._connect()
        try:
            client.ping()
        except Exception as exc:
            self._raise(exc)
        self.link.saw(True)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        def build(pipe: Any) -> None:
            for k in keys:
                pipe.exists(k)

        return [bool(n) for n in self._run(build)]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def build(pipe: Any) -> None:
            for k in keys:
                pipe.get(k)

        return self._run(build)

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray]], ttl_s: int) -> None:
        def build(pipe: Any) -> None:
            for k, v in items:
                pipe.set(k, v, ex=ttl_s or None)

        self._run(build)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception as exc:
                log.debug("event=remote_close_failed reason=%r", exc)
            self._client = None


Call = Callable[[RemoteStore], Callable[[], None]]


class RemoteThread:
    """Runs calls on a `RemoteStore` of its own, one at a time, in order. A call
    returns what the loop should do with its result (a callable), which goes
    to `post`; a call that raises is logged and its loop part dropped."""

    def __init__(
        self, name: str, store: RemoteStore, post: Callable[[Callable[[], None]], object]
    ) -> None:
        self.store = store
        self._post = post
        self._queue: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Call) -> None:
        self._queue.put(call)

    def _main(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                break
            try:
                done = call(self.store)
            except Exception:  # a bug in a call must not end the thread
                log.exception("event=remote_call_failed thread=%s", self._thread.name)
                continue
            try:
                self._post(done)
            except RuntimeError:  # the loop is closed: the daemon is exiting
                break
        self.store.close()

    def close(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)
