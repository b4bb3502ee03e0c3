"""Runs in the daemon: the lookups schedulers answered from the ready table (`Observe`, SPEC 15).

An `Observe` frame is bounded like every other verb: at most
`MAX_KEYS_PER_REQUEST` keys in all its lookups (one frame under the 8 MiB
cap once carried 2.5M keys), and each lookup's hit count at most its keys
(`hits` feeds `hit_blocks`). A frame too big is refused before it is
decoded whole (`oversized`: its shape is read without making its keys, 10
ms for 8 MiB instead of a quarter of a second), a bad one is `BAD_REQUEST`
and changes nothing.

What the policy learns from them (`BlockIndex.observe`: the adaptive
policy replays each lookup in its miniatures, about 7 us a key) is not done
while the frame is handled: `ObservedLookups` queues the lookups, and the
server applies them `OBSERVE_KEYS_PER_TURN` keys a loop turn (a lookup
longer than that in consecutive pieces), requests served in between. The
queue holds at most `MAX_QUEUED_KEYS` keys; past that the oldest go
(counted, `observed_keys_dropped`): what the policy learns is advice, and a
daemon that cannot keep up drops it rather than fall behind its requests.
"""

from __future__ import annotations

from collections import Counter, deque

import msgspec

from kvd.control.pool import Pool
from kvd.control.pools import PoolRegistry
from kvd.errors import BadRequest
from kvd_client import protocol as p

OBSERVE_KEYS_PER_TURN = 2048  # keys taught to the policies per loop turn (~15 ms, adaptive)
MAX_QUEUED_KEYS = 4 * p.MAX_KEYS_PER_REQUEST
# The shortest frame that can hold more keys than allowed: a key is 3 bytes at least.
OVERSIZED_FROM_BYTES = 3 * p.MAX_KEYS_PER_REQUEST


class _ObserveShape(msgspec.Struct, frozen=True, tag="Observe", array_like=True):
    """An `Observe` frame with its lookups left undecoded (msgpack arrays)."""

    req_id: int
    lookups: list[msgspec.Raw]


_SHAPE = msgspec.msgpack.Decoder(_ObserveShape)


def _array_length(raw: msgspec.Raw) -> int:
    """The length in a msgpack array's header; 0 for anything else (the full
    decode then says what is wrong)."""
    start = memoryview(raw)[:5]
    if not start:
        return 0
    head = start[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(start) >= 3:
        return int.from_bytes(start[1:3], "big")
    if head == 0xDD and len(start) >= 5:
        return int.from_bytes(start[1:5], "big")
    return 0


def oversized(frame: bytes) -> tuple[int, str] | None:
    """(req_id, why) when `frame` is an `Observe` of more keys than one request may
    carry, read from its arrays' headers without decoding its keys; else None."""
    if len(frame) <= OVERSIZED_FROM_BYTES:
        return None
    try:
        shape = _SHAPE.decode(frame)
        total = sum(map(_array_length, shape.lookups))
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError):
        return None  # not an Observe, or malformed: the full decode answers it
    if total <= p.MAX_KEYS_PER_REQUEST:
        return None
    req_id = shape.req_id if 0 <= shape.req_id < 1 << 63 else 0
    return req_id, _too_many(total)


def _too_many(total: int) -> str:
    return f"Observe carries {total} keys; one request carries at most {p.MAX_KEYS_PER_REQUEST}"


def check_observe(req: p.Observe) -> int:
    """The keys of a valid `Observe`; `BadRequest` (nothing changed) otherwise."""
    lookups, hits = req.lookups, req.hits
    total = sum(map(len, lookups))
    if total > p.MAX_KEYS_PER_REQUEST:
        raise BadRequest(_too_many(total))
    if hits and len(hits) != len(lookups):
        raise BadRequest(f"Observe: {len(hits)} hit counts for {len(lookups)} lookups")
    for i, (keys, n) in enumerate(zip(lookups, hits, strict=False)):
        if n > len(keys):
            raise BadRequest(f"Observe: lookup {i} counts {n} hits of {len(keys)} keys")
    return total


class ObservedLookups:
    """The observed lookups the policies have not learned yet, oldest first."""

    def __init__(self, pools: PoolRegistry, counters: Counter[str]) -> None:
        self.pools = pools
        self.counters = counters
        self._queue: deque[tuple[Pool, list[bytes]]] = deque()
        self.queued_keys = 0

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, pool: Pool, req: p.Observe) -> None:
        """Counts a checked `Observe` (as if its lookups had come here) and queues
        its lookups for the pool's policy."""
        total = check_observe(req)
        counters = self.counters
        counters["observed_lookups"] += len(req.lookups)
        counters["lookups"] += len(req.lookups)
        counters["lookup_keys"] += total
        counters["hit_blocks"] += sum(req.hits)
        queue, cut = self._queue, OBSERVE_KEYS_PER_TURN
        for keys in req.lookups:
            if len(keys) <= cut:
                if keys:
                    queue.append((pool, keys))
            else:  # a long lookup in pieces, so that no turn takes long
                queue.extend((pool, keys[i : i + cut]) for i in range(0, len(keys), cut))
        self.queued_keys += total
        while self.queued_keys > MAX_QUEUED_KEYS:
            _, keys = queue.popleft()
            self.queued_keys -= len(keys)
            counters["observed_keys_dropped"] += len(keys)

    def apply(self, budget: int = OBSERVE_KEYS_PER_TURN) -> bool:
        """Teaches the policies about `budget` keys of the queued lookups (the last
        piece whole); True while some are left for the next turn. A pool dropped,
        re-created or being reset since learns nothing."""
        queue, find = self._queue, self.pools.find
        while queue and budget > 0:
            pool, keys = queue.popleft()
            self.queued_keys -= len(keys)
            budget -= len(keys)
            if find(pool.name) is pool and not pool.resetting:
                pool.index.observe(keys)
        return bool(queue)
