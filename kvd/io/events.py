"""Runs in the daemon: KV events in vLLM's wire format, published and replayed (SPEC section 8).

Existing consumers (vLLM's `kv_events_subscriber` example, llm-d's kv-cache
indexer, Dynamo's router) read them unchanged:

    PUB     [topic, seq (8 bytes, big-endian), payload]
    payload msgpack KVEventBatch = [ts, [event, ...], data_parallel_rank]
    event   ["BlockStored", block_hashes, parent_block_hash, token_ids,
             block_size, lora_id, medium, lora_name]
            ["BlockRemoved", block_hashes, medium]
            ["AllBlocksCleared"]

    replay  ROUTER; request  [identity, <envelope ... b"">, start_seq (8 bytes)]
                    replies  [identity, <envelope>, seq, payload] per buffered
                             batch with seq >= start_seq, then
                             [identity, <envelope>, -1 (8 bytes), b""]

The envelope is whatever the client put before the empty delimiter: nothing
for a DEALER, `b""` for a REQ (as vLLM's publisher expects). A REQ socket
takes one reply per request, so a REQ client sees the first batch (or the
end marker) only; a DEALER client sees the whole stream.

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
from typing import Any

import msgspec
import zmq

from kvd_client.types import OffloadingEvent

log = logging.getLogger("kvd.io.events")

DEFAULT_TOPIC = "kv@{hostname}@{pool}"
DEFAULT_BUFFER_SIZE = 10_000
DEFAULT_BUFFER_BYTES = 64 << 20
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# A replay request is a few short frames; anything larger is not one.
_MAX_REQUEST_BYTES = 4096
# Replay requests answered per `handle_replay` call, so a flood of them
# cannot starve the control socket.
_MAX_REQUESTS_PER_CALL = 64

ExternalBlockHash = bytes | int


# omit_defaults never trims an array-like struct: a batch is [ts, events, None],
# three elements, as vLLM's own are.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True, tag=True
):
    """Base of the tagged events; the tag is the class name."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # Required, not defaulted: vLLM's own types (0.12 on) require it, and
    # consumers with the older six fields ignore a trailing element.
    lora_name: str | None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """Every block of the pool is gone (start, reset, drop)."""


class KVEventBatch(EventBatch, frozen=True):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hashes(keys: Sequence[bytes], as_int: bool) -> list[ExternalBlockHash]:
    """Keys as event block hashes; with `as_int`, 8-byte keys become the unsigned
    int they were sent as (what vLLM publishes by default), other keys stay bytes."""
    if not as_int:
        return list(keys)
    return [int.from_bytes(k, "big") if len(k) == 8 else k for k in keys]


def to_wire(event: OffloadingEvent, int_block_hashes: bool = False) -> BlockStored | BlockRemoved:
    """The vLLM event for one index event. The daemon never sees tokens, so
    `token_ids` is empty and `parent_block_hash` is None."""
    hashes = block_hashes(event.keys, int_block_hashes)
    if event.removed:
        return BlockRemoved(hashes, event.medium)
    return BlockStored(hashes, None, [], event.block_tokens, None, event.medium, None)


def format_topic(topic_format: str, hostname: str, pool: str) -> bytes:
    return topic_format.format(hostname=hostname, pool=pool).encode()


def parse_replay_request(frames: Sequence[bytes]) -> tuple[list[bytes], int | None]:
    """Splits `[identity, *envelope, body]` (identity already removed) into the
    envelope to echo and the start sequence; None when the body is not 8 bytes."""
    cut = 0
    for i, frame in enumerate(frames):
        if not frame:
            cut = i + 1
            break
    envelope, body = list(frames[:cut]), frames[cut:]
    if len(body) != 1 or len(body[0]) != 8:
        return envelope, None
    return envelope, int.from_bytes(body[0], "big")


class EventPublisher:
    """Owns the PUB and replay ROUTER sockets; every method runs on the loop thread.

    An endpoint of "" disables that socket. `ipc://` socket files are made
    0660 and given group `gid` when set.
    """

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
        hwm: int = 100_000,
    ) -> None:
        if buffer_size < 0:
            raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.topic_format = topic_format
        try:
            format_topic(topic_format, self.hostname, "pool")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"bad topic format {topic_format!r}: use {{hostname}} and {{pool}} ({exc!r})"
            ) from None
        self.int_block_hashes = int_block_hashes
        self.batches_sent = 0
        self.events_sent = 0
        self.replays_served = 0
        self._gid = gid
        self._seq = 0
        self._pending: dict[str, list[BlockStored | BlockRemoved | AllBlocksCleared]] = {}
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
        self._ring: deque[tuple[int, bytes]] = deque(
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

    def add(self, pool: str, events: Sequence[OffloadingEvent]) -> None:
        """Buffers a pool's index events, oldest first, for the next `flush`."""
        if self._pub is None and self._replay is None:
            return
        wire = [to_wire(e, self.int_block_hashes) for e in events if e.keys]
        if wire:
            self._pending.setdefault(pool, []).extend(wire)

    def all_cleared(self, pool: str) -> None:
        """Buffers an AllBlocksCleared (pool declared, reset or dropped)."""
        if self._pub is None and self._replay is None:
            return
        self._pending.setdefault(pool, []).append(AllBlocksCleared())

    def flush(self, now_ts: float) -> int:
        """Sends one batch per pool with pending events, each with the next
        sequence number, and keeps it for replay. Returns the batches sent."""
        if not self._pending:
            return 0
        pending, self._pending = self._pending, {}
        for pool, events in pending.items():
            seq = self._seq
            self._seq += 1
            payload = self._encode(KVEventBatch(now_ts, events))
            if self._pub is not None:
                # A PUB never blocks: a slow subscriber loses messages and
                # asks the replay socket for them by sequence number.
                self._pub.send_multipart(
                    (self.topic(pool), seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                )
            self._keep(seq, payload)
            self.events_sent += len(events)
        self.batches_sent += len(pending)
        return len(pending)

    def _keep(self, seq: int, payload: bytes) -> None:
        ring = self._ring
        if ring.maxlen == 0:
            return
        if len(ring) == ring.maxlen:
            self._ring_bytes -= len(ring[0][1])  # the deque drops it on append
        ring.append((seq, payload))
        self._ring_bytes += len(payload)
        while self._ring_bytes > self.buffer_bytes and len(ring) > 1:
            self._ring_bytes -= len(ring.popleft()[1])
            self.batches_dropped += 1

    @property
    def ring_bytes(self) -> int:
        """Bytes of the batches kept for replay."""
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
        batches: Iterable[tuple[int, bytes]] = ()
        if start is None:
            log.warning("event=replay_request_malformed frames=%d", len(frames) - 1)
        elif self._ring:
            # Sequence numbers in the ring are consecutive: skip straight to `start`.
            skip = min(max(0, start - self._ring[0][0]), len(self._ring))
            batches = itertools.islice(self._ring, skip, None)
        head = [identity, *envelope]
        sent = 0
        try:
            for seq, payload in batches:
                sock.send_multipart([*head, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                sent += 1
            sock.send_multipart([*head, END_SEQ, b""], zmq.NOBLOCK)
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
