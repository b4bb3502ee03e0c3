"""Runs in the daemon: KV events in vLLM's wire format, published and replayed (SPEC section 8).

The framing is vLLM 0.32's `ZmqEventPublisher`'s; the event types are in
`kvd.io.event_wire` (tagged maps by default, the older arrays behind
`events_format = "array"`):

    PUB     [topic, seq (8 bytes, big-endian), payload]
    payload msgpack KVEventBatch = [ts, [event, ...], data_parallel_rank]

    replay  ROUTER; request  [identity, b"", start_seq (8 bytes)]
                    replies  [identity, b"", topic, seq, payload] per buffered
                             batch with seq >= start_seq, then
                             [identity, b"", b"", END_SEQ (-1, 8 bytes), b""]

A vLLM client is a DEALER that sends `[b"", start_seq]` and reads until the
end marker. What comes before the empty delimiter is echoed as it came, so a
bare DEALER (no delimiter) gets `[topic, seq, payload]` and `[b"", END_SEQ,
b""]`, and a REQ with REQ_CORRELATE gets its request id back. A plain REQ
takes one reply per request, so it sees the first batch (or the end marker)
only.

`add` and `all_cleared` only buffer; `flush` sends one batch per pool, so a
loop turn that stored a thousand blocks costs one message, not a thousand.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvd.io.event_wire import (
    ALL_CLEARED,
    END_SEQ,
    TO_WIRE,
    EventBatch,
    EventFormat,
    WireEvent,
    format_topic,
    parse_replay_request,
)
from kvd_client.protocol import Group
from kvd_client.types import OffloadingEvent

if TYPE_CHECKING:
    from kvd.config import Config

log = logging.getLogger("kvd.io.events")

DEFAULT_TOPIC = "kv@{hostname}@{pool}"
DEFAULT_BUFFER_SIZE = 10_000
DEFAULT_BUFFER_BYTES = 64 << 20
# A replay request is a few short frames; anything larger is not one.
_MAX_REQUEST_BYTES = 4096
# Replay requests answered per `handle_replay` call, so a flood of them
# cannot starve the control socket.
_MAX_REQUESTS_PER_CALL = 64


def _size(kept: tuple[int, bytes, bytes]) -> int:
    return len(kept[1]) + len(kept[2])


class EventPublisher:
    """Owns the PUB and replay ROUTER sockets; every method runs on the loop thread.

    An endpoint of "" disables that socket. `ipc://` socket files are made
    0660 and given group `gid` when set.
    """

    @classmethod
    def from_config(
        cls, ctx: zmq.Context[zmq.Socket[bytes]], cfg: Config, gid: int | None
    ) -> EventPublisher:
        """The publisher the daemon's `events_*` settings describe."""
        return cls(
            ctx, cfg.events_endpoint, cfg.replay_endpoint,
            buffer_size=cfg.events_buffer, buffer_bytes=cfg.events_buffer_bytes,
            topic_format=cfg.events_topic, gid=gid,
            int_block_hashes=cfg.events_int_hashes, event_format=cfg.events_format,
        )  # fmt: skip

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        pub_endpoint: str,
        replay_endpoint: str = "",
        *,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        hostname: str | None = None,
        topic_format: str = DEFAULT_TOPIC,
        gid: int | None = None,
        int_block_hashes: bool = False,
        event_format: EventFormat = "map",
        hwm: int = 100_000,
    ) -> None:
        if buffer_size < 0:
            raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")
        if event_format not in TO_WIRE:
            raise ValueError(f"event_format must be 'map' or 'array', got {event_format!r}")
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.topic_format = topic_format
        try:
            format_topic(topic_format, self.hostname, "pool")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"bad topic format {topic_format!r}: use {{hostname}} and {{pool}} ({exc!r})"
            ) from None
        self.int_block_hashes = int_block_hashes
        self.event_format = event_format
        self._to_wire = TO_WIRE[event_format]
        self._all_cleared = ALL_CLEARED[event_format]
        self.batches_sent = 0
        self.events_sent = 0
        self.replays_served = 0
        self._gid = gid
        self._seq = 0
        self._pending: dict[str, list[WireEvent]] = {}
        self._encode = msgspec.msgpack.Encoder().encode
        self._files: list[str] = []
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if pub_endpoint:
                self._pub = ctx.socket(zmq.PUB)
                self._pub.setsockopt(zmq.LINGER, 0)
                self._pub.setsockopt(zmq.SNDHWM, hwm)
                self._bind(self._pub, pub_endpoint)
            if replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
                # Fail loudly (zmq.Again, EHOSTUNREACH) rather than drop a batch
                # from the middle of a replay: a replay must have no gaps.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.SNDHWM, max(1000, 2 * buffer_size + 2))
                self._bind(self._replay, replay_endpoint)
        except BaseException:
            self.close()
            raise
        # Only a replay socket ever reads the ring; without one, keep nothing.
        self._ring: deque[tuple[int, bytes, bytes]] = deque(
            maxlen=buffer_size if self._replay is not None else 0
        )
        # The ring is bounded in bytes too: one batch can carry 65,536 keys.
        self.buffer_bytes = buffer_bytes
        self._ring_bytes = 0
        self.batches_dropped = 0  # batches that left the ring for its byte bound

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str) -> None:
        path = endpoint.removeprefix("ipc://") if endpoint.startswith("ipc://") else None
        if path is not None and not path.startswith("@"):  # "@": abstract, no file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a socket file left by a killed daemon
        sock.bind(endpoint)
        if path is not None and not path.startswith("@"):
            self._files.append(path)
            os.chmod(path, 0o660)
            if self._gid is not None:
                os.chown(path, -1, self._gid)

    # -- endpoints -------------------------------------------------------------

    @property
    def pub_endpoint(self) -> str:
        """The bound PUB endpoint (a tcp port 0 resolved), or "" when disabled."""
        return "" if self._pub is None else self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str:
        if self._replay is None:
            return ""
        return self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_fd(self) -> int | None:
        """The replay socket's edge-triggered FD to watch; None when replay is off."""
        return None if self._replay is None else int(self._replay.getsockopt(zmq.FD))

    @property
    def next_seq(self) -> int:
        return self._seq

    @property
    def pending(self) -> bool:
        """True when `flush` has something to send."""
        return bool(self._pending)

    def topic(self, pool: str) -> bytes:
        return format_topic(self.topic_format, self.hostname, pool)

    # -- publishing ------------------------------------------------------------

    def add(
        self, pool: str, events: Sequence[OffloadingEvent], groups: Sequence[Group] = ()
    ) -> None:
        """Buffers a pool's index events, oldest first, for the next `flush`;
        `groups` are the pool's layout's (`event_wire`: what each group's carry)."""
        if self._pub is None and self._replay is None:
            return
        as_int, to_wire = self.int_block_hashes, self._to_wire
        wire = [w for e in events if e.keys for w in to_wire(e, as_int, groups)]
        if wire:
            self._pending.setdefault(pool, []).extend(wire)

    def all_cleared(self, pool: str) -> None:
        """Buffers an AllBlocksCleared (pool declared, reset or dropped)."""
        if self._pub is None and self._replay is None:
            return
        self._pending.setdefault(pool, []).append(self._all_cleared)

    def flush(self, now_ts: float) -> int:
        """Sends one batch per pool with pending events, each with the next
        sequence number, and keeps it for replay. Returns the batches sent."""
        if not self._pending:
            return 0
        pending, self._pending = self._pending, {}
        for pool, events in pending.items():
            seq = self._seq
            self._seq += 1
            topic = self.topic(pool)
            payload = self._encode(EventBatch(now_ts, events))
            if self._pub is not None:
                # A PUB never blocks: a slow subscriber loses messages and
                # asks the replay socket for them by sequence number.
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self._keep(seq, topic, payload)
            self.events_sent += len(events)
        self.batches_sent += len(pending)
        return len(pending)

    def _keep(self, seq: int, topic: bytes, payload: bytes) -> None:
        """Keeps a batch with its topic: a replay answers each batch under the
        topic it was published on, as vLLM's publisher does."""
        ring = self._ring
        if ring.maxlen == 0:
            return
        if len(ring) == ring.maxlen:
            self._ring_bytes -= _size(ring[0])  # the deque drops it on append
        ring.append((seq, topic, payload))
        self._ring_bytes += len(topic) + len(payload)
        while self._ring_bytes > self.buffer_bytes and len(ring) > 1:
            self._ring_bytes -= _size(ring.popleft())
            self.batches_dropped += 1

    @property
    def ring_bytes(self) -> int:
        """Bytes of the batches kept for replay (payloads and topics)."""
        return self._ring_bytes

    # -- replay ----------------------------------------------------------------

    def handle_replay(self) -> bool:
        """Answers the queued replay requests without blocking. Returns True when
        it stopped with requests possibly left (call again soon), False when drained."""
        sock = self._replay
        if sock is None:
            return False
        for _ in range(_MAX_REQUESTS_PER_CALL):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            self._answer(sock, frames)
        return True

    def _answer(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        identity = frames[0]
        envelope, start = parse_replay_request(frames[1:])
        batches: Iterable[tuple[int, bytes, bytes]] = ()
        if start is None:
            log.warning("event=replay_request_malformed frames=%d", len(frames) - 1)
        elif self._ring:
            # Sequence numbers in the ring are consecutive: skip straight to `start`.
            skip = min(max(0, start - self._ring[0][0]), len(self._ring))
            batches = itertools.islice(self._ring, skip, None)
        head = [identity, *envelope]
        sent = 0
        try:
            for seq, topic, payload in batches:
                sock.send_multipart([*head, topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                sent += 1
            sock.send_multipart([*head, b"", END_SEQ, b""], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer left or its queue is full: it retries
            log.warning("event=replay_abandoned sent=%d reason=%s", sent, exc)
            return
        self.replays_served += 1

    # -- lifetime --------------------------------------------------------------

    def close(self, linger_ms: int = 0) -> None:
        """Closes both sockets and unlinks their socket files; idempotent."""
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
        self._pub = self._replay = None
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._files.clear()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
