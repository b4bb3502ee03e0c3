"""Runs in engine processes: one DEALER socket and one daemon session, kept alive.

All ZeroMQ traffic of a client goes through here. Requests are synchronous
(send, then wait for the reply with the same `req_id`) under a lock, so the
caller's thread and the keeper thread share one socket safely. A reply that
does not come within `timeout_ms` marks the connection down; the socket is
dropped (so nothing stale is replayed) and the keeper thread reconnects with
backoff, says `Hello` again and runs `on_connect` (attach). While connected,
the keeper heartbeats at a third of the lease unless traffic already renewed it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from kvd_client import protocol as p
from kvd_client.errors import ErrorCode, KvdError, Unavailable, error_for

log = logging.getLogger("kvd_client")
R = TypeVar("R")
_SESSION_LOST = {ErrorCode.NOT_HELLO, ErrorCode.NO_SUCH_POOL, ErrorCode.NOT_ATTACHED}
# Requests whose errors are about the pool they name, not about this session.
_NAMES_A_POOL = (p.Hello, p.Attach, p.DropPool, p.Reset)


class Connection:
    def __init__(
        self,
        endpoint: str,
        *,
        role: p.Role,
        engine_id: str = "",
        rank: int = 0,
        world_size: int = 1,
        timeout_ms: int = 1000,
        on_connect: Callable[[Connection], None] | None = None,
        keeper: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.role: p.Role = role
        self.engine_id = engine_id
        self.rank = rank
        self.world_size = world_size
        self.timeout_ms = timeout_ms
        self.on_connect = on_connect
        self.welcome: p.Welcome | None = None
        self.pushed: deque[p.TransferJob] = deque()
        self.on_disconnect: Callable[[], None] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._lock = threading.RLock()
        self._next_req = 1
        self._posted: dict[int, str] = {}  # req_id -> verb, of `post`s not answered yet
        self._last_sent = 0.0
        self._rcvtimeo = -1
        self._ready = False
        self._closed = threading.Event()
        self._keeper: threading.Thread | None = None
        self._use_keeper = keeper
        # Presented in every Hello of this connection: the daemon knows a
        # reconnect of this process from another process on the same rank.
        self.instance = uuid.uuid4().hex
        # `(tag, t)`: the daemon answered, in the session the owner tagged `tag`
        # (`Scheduler.epoch`), a request sent at monotonic time t, so it renewed that
        # session's lease at t or later: the session, and what it prepared and pinned,
        # outlive t by at least the lease (SPEC 7). Set once the session is up.
        self.tag = 0
        self.acked: tuple[int, float] = (0, 0.0)

    # -- lifecycle -------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True once Hello (and attach) succeeded, until the session is lost."""
        return self._ready

    def start(self) -> None:
        """Connects once now (errors other than unreachable raise), then keeps it alive."""
        try:
            self.connect()
        except Unavailable as exc:
            log.warning(
                "kvd daemon unreachable at %s (%s); retrying in the background", self.endpoint, exc
            )
        if self._use_keeper and self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="kvd-keeper", daemon=True)
            self._keeper.start()

    def connect(self) -> p.Welcome:
        with self._lock:
            self._drop()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            # A send waits at most the timeout for room (the daemon gone or hung,
            # the queue full): never longer than a reply would (SPEC 7).
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.connect(self.endpoint)
            self._rcvtimeo = -1
            self._sock = sock
            try:
                reply = self.call(
                    p.Hello,
                    p.PROTOCOL_VERSION,
                    self.role,
                    self.engine_id,
                    self.rank,
                    self.world_size,
                    os.getpid(),
                    self.instance,
                )
                assert isinstance(reply, p.Welcome)
                self.welcome = reply
                if self.on_connect is not None:
                    self.on_connect(self)
                self._ready = True
            except BaseException:
                self._drop()
                raise
            return reply

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._sock is not None:
                # If this fails the daemon expires the lease instead.
                with contextlib.suppress(KvdError):
                    self._request(p.Goodbye(self._take_id()), min(self.timeout_ms, 500))
            self._drop()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(timeout=2)

    def _drop(self) -> None:
        self._ready = False
        self._posted.clear()  # their replies, if any, went with the socket
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(linger=0)
            if self.on_disconnect is not None:
                self.on_disconnect()

    # -- requests --------------------------------------------------------------

    def _take_id(self) -> int:
        req_id = self._next_req
        self._next_req += 1
        return req_id

    def call(self, cls: Callable[..., Any], *args: Any) -> p.Reply:
        """Sends `cls(req_id, *args)` and returns its reply; `Error` replies raise."""
        with self._lock:
            return self._request(cls(self._take_id(), *args), self.timeout_ms)

    def post(self, cls: Callable[..., Any], *args: Any) -> bool:
        """Sends `cls(req_id, *args)` without waiting: for requests nothing waits on
        (reports, releases). The daemon takes it before anything sent later on this
        socket; its reply is read by the next call (a refusal is logged,
        `_unclaimed`). True when sent, or when the socket it was meant for was
        dropped meanwhile (what that session held went with it); False when not
        connected, or when the socket's queue is full (nothing sent)."""
        with self._lock:
            req_id = self._take_id()
            meant_for = self._sock
        if meant_for is None:
            return False
        frame = p.encoder.encode(cls(req_id, *args))  # outside the lock: it may be long
        with self._lock:
            sock = self._sock
            if sock is not meant_for:
                return True  # a reconnect: the new session must not get the old one's
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                return False
            # Not `_last_sent`: heartbeats go on, so a dead daemon is noticed.
            self._posted[req_id] = getattr(cls, "__name__", str(cls))
            return True

    def _unclaimed(self, reply: p.Reply) -> bool:
        """A reply no caller waits for: to a `post` (its refusal is logged, as
        nobody else sees it) or to a request that timed out (already reported).
        True when it says the session is lost."""
        verb = self._posted.pop(reply.req_id, None)
        if verb is None or not isinstance(reply, p.Error):
            return False
        err = error_for(reply.code, reply.detail)
        lost = err.code in _SESSION_LOST
        # A lost session: the caller reconnects (the daemon rolled the session's
        # pins back); anything else is a refusal to see.
        log.log(logging.DEBUG if lost else logging.WARNING,
                "the kvd daemon refused a %s sent without waiting: %s", verb, err)  # fmt: skip
        return lost

    def _request(self, msg: p.Request, timeout_ms: int) -> p.Reply:
        sock = self._sock
        if sock is None:
            raise Unavailable(f"not connected to the kvd daemon at {self.endpoint}")
        frame = p.encoder.encode(msg)
        sent = time.monotonic()  # before the send: the daemon renews the lease later
        try:
            sock.send(frame)  # waits up to SNDTIMEO while the socket's queue is full
        except zmq.Again:
            self._drop()
            raise Unavailable(
                f"the kvd daemon at {self.endpoint} takes no requests (queue full "
                f"for {self.timeout_ms} ms)"
            ) from None
        self._last_sent = sent
        deadline = sent + timeout_ms / 1000
        wait_ms = timeout_ms
        while True:
            # One blocking recv with a timeout: cheaper than poll() then recv().
            if wait_ms != self._rcvtimeo:
                self._rcvtimeo = wait_ms
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            try:
                frame = sock.recv()
            except zmq.Again:
                self._drop()
                raise Unavailable(
                    f"no reply from the kvd daemon at {self.endpoint} within {timeout_ms} ms"
                ) from None
            reply = p.reply_decoder.decode(frame)
            if isinstance(reply, p.TransferJob):
                self.pushed.append(reply)
            elif reply.req_id == msg.req_id:
                if isinstance(reply, p.Error):
                    err = error_for(reply.code, reply.detail)
                    if err.code in _SESSION_LOST and not isinstance(msg, _NAMES_A_POOL):
                        # The daemon restarted or the pool went: reconnect. To the
                        # caller this is "unreachable", like a timeout (SPEC 7).
                        self._drop()
                        raise Unavailable(f"session lost ({err}); reconnecting") from err
                    if self._ready:
                        self.acked = (self.tag, sent)
                    raise err
                if self._ready:
                    self.acked = (self.tag, sent)
                return reply
            else:
                self._unclaimed(reply)
            wait_ms = max(1, int((deadline - time.monotonic()) * 1000))

    def receive(self, timeout_ms: int) -> int:
        """Waits up to `timeout_ms` for pushed jobs; returns how many are queued."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return len(self.pushed)
            while sock.poll(timeout_ms, zmq.POLLIN):
                reply = p.reply_decoder.decode(sock.recv())
                if isinstance(reply, p.TransferJob):
                    self.pushed.append(reply)
                elif self._unclaimed(reply):
                    self._drop()  # the keeper reconnects
                    break
                timeout_ms = 0
        return len(self.pushed)

    # -- keeper thread ---------------------------------------------------------

    def _keep(self) -> None:
        backoff = 0.05
        while not self._closed.is_set():
            if self._sock is None:
                if self._closed.wait(backoff):
                    return
                try:
                    self.connect()
                    log.info("reconnected to the kvd daemon at %s", self.endpoint)
                    backoff = 0.05
                except KvdError as exc:
                    backoff = min(backoff * 2, 2.0)
                    log.debug("reconnect failed: %s", exc)
                continue
            lease_s = (self.welcome.lease_ms if self.welcome else 10_000) / 1000
            interval = lease_s / 3
            if self._closed.wait(max(0.01, interval / 2)):
                return
            if time.monotonic() - self._last_sent >= interval:
                try:
                    self.call(p.Heartbeat)
                except KvdError as exc:
                    log.warning("heartbeat failed: %s", exc)
