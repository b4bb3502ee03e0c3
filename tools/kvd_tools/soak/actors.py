"""Runs in a soak actor process: a scheduler that drives the index verbs, with no data.

Each actor is one `kvd_client.Scheduler` doing random lookups, stores
(`prepare_store`, a short hold, `complete_store` with success or failure) and
loads (`lookup`, `prepare_load`, a short hold, `complete_load`) on prefix
chains of actor keys, plus a little deliberate misuse. It moves no bytes, so
it checks only what the protocol promises:

- `lookup` answers None or 0 <= hits <= len(keys);
- `prepare_store` allocates distinct in-range slots for a subset of the keys,
  in order, and never evicts a key of the same call;
- `prepare_load` answers one in-range slot per key;
- blocks this session pins stay present and ready until it releases them;
- its own completions succeed, and another session's are `NOT_OWNER`.

A check counts only while the session is provably the same one (same session
id on the same pool generation, still connected): a daemon restart or a lease
expiry rolls the session back, and then the daemon owes it nothing.
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvd_client import Scheduler
from kvd_client.errors import ErrorCode, KvdError, MissingKey, NotReady
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.workload import (
    ACTOR_KEYS,
    CAPACITY_BYTES,
    MAX_ACTOR_CHAIN,
    POOL,
    actor_key,
    layout,
)

# Codes that mean "the daemon restarted or rolled this session back".
SESSION_LOST = {
    ErrorCode.NOT_HELLO,
    ErrorCode.NOT_ATTACHED,
    ErrorCode.NO_SUCH_POOL,
    ErrorCode.UNAVAILABLE,
}
# Calls that SPEC section 7 says never raise into the engine's hot path.
HOT_PATH = {
    "lookup",
    "touch",
    "prepare_store",
    "complete_store",
    "complete_load",
    "store",
    "finished",
}
HOT_KEYS = 300
T = TypeVar("T")


def count_failure(tally: Tally, slot: int, who: str, call: str, exc: Exception) -> bool:
    """Counts one client call that raised: a lost session (and whether it raised
    into the hot path, which it must not), else a violation. True when the
    error is not kvd's: the library broke a promise, so re-create the client."""
    if not isinstance(exc, KvdError):
        detail = "".join(traceback.format_exception(exc, limit=4))
        tally.violation(slot, f"{who}: {call} crashed: {detail!r}")
        tally.add(slot, "recreated")
        return True
    if exc.code not in SESSION_LOST:
        tally.violation(slot, f"{who}: {call} raised {exc}")
    else:
        tally.add(slot, "session_lost")
        if call in HOT_PATH:
            tally.add(slot, "hot_path_raises")
    return False


def actor_main(tally: Tally, slot: int, endpoint: str, seed: int) -> None:
    """Process entry point: runs until the harness sets the stop flag (or kills it)."""
    tally.log_to_file(f"actor{slot}")
    actor = Actor(tally, slot, endpoint, seed)
    try:
        while not tally.stopped:
            actor.step()
    finally:
        actor.sched.close()


class Actor:
    def __init__(self, tally: Tally, slot: int, endpoint: str, seed: int) -> None:
        self.tally = tally
        self.slot = slot
        self.endpoint = endpoint
        self.rng = random.Random(seed)
        self.call = ""
        self.sched = self._open()

    def _open(self) -> Scheduler:
        return Scheduler(
            POOL,
            layout(),
            engine_id=f"soak-actor-{self.slot}",
            endpoint=self.endpoint,
            capacity_bytes=CAPACITY_BYTES,
            timeout_ms=1000,
        )

    def step(self) -> None:
        r = self.rng.random()
        try:
            if r < 0.40:
                self._lookup()
            elif r < 0.70:
                self._store()
            elif r < 0.97:
                self._load()
            else:
                self._misuse()
        except Exception as exc:  # a client call raised: counted, see count_failure
            if count_failure(self.tally, self.slot, "actor", self.call, exc):
                self.sched.close()
                self.sched = self._open()

    # -- operations ------------------------------------------------------------

    def _lookup(self) -> None:
        keys = self._chain()
        hits = self._count("lookup", self.sched.lookup(keys))
        if hits is not None and not 0 <= hits <= len(keys):
            self._violation(f"lookup of {len(keys)} keys answered {hits}")
        if hits:
            self.call = "touch"
            self.sched.touch(keys[:hits])
            self._count("touch", None)

    def _store(self) -> None:
        keys = self._chain()
        before = self._session()
        self.call = "prepare_store"
        out = self._count("prepare_store", self.sched.prepare_store(keys))
        if out is None:
            return
        stored, slots = out.keys_to_store, out.store_spec.slots
        num_blocks = self.sched.attached.num_blocks if self.sched.attached else 0
        wanted = [k for k in dict.fromkeys(keys) if k in set(stored)]
        if wanted != stored or len(slots) != len(stored) or len(set(slots)) != len(slots):
            self._violation(f"prepare_store {keys!r} -> keys {stored!r} slots {slots!r}")
        if any(not 0 <= s < num_blocks for s in slots):
            self._violation(f"prepare_store slot out of range: {slots!r} of {num_blocks}")
        if set(out.evicted_keys) & set(keys):
            self._violation(f"prepare_store evicted a key of its own call: {out.evicted_keys!r}")
        if not stored:
            return
        self._hold()
        success = self.rng.random() > 0.1
        self._complete("complete_store", lambda: self.sched.complete_store(stored, success), before)

    def _load(self) -> None:
        keys = self._chain()
        self.call = "lookup"
        hits = self._count("lookup", self.sched.lookup(keys))
        if not hits:
            return
        pinned = keys[:hits]
        before = self._session()
        self.call = "prepare_load"
        try:
            spec = self._count("prepare_load", self.sched.prepare_load(pinned))
        except (MissingKey, NotReady):
            self.tally.add(self.slot, "races")  # evicted or re-stored since the lookup
            return
        num_blocks = self.sched.attached.num_blocks if self.sched.attached else 0
        if len(spec.slots) != hits or any(not 0 <= s < num_blocks for s in spec.slots):
            self._violation(f"prepare_load of {hits} keys answered slots {spec.slots!r}")
        self._hold()
        self.call = "lookup"
        again = self._count("lookup", self.sched.lookup(pinned))
        if again != hits and self._same(before):
            self._violation(f"{hits} pinned blocks, but a lookup found {again}")
        self._complete("complete_load", lambda: self.sched.complete_load(pinned), before)

    def _misuse(self) -> None:
        before = self._session()
        if self.rng.random() < 0.5:
            # Never pinned by this session (it releases every pin it takes).
            self.call = "misuse_complete_load"
            expected = ErrorCode.NOT_OWNER
            keys = self._chain()
            fn: Callable[[Sequence[bytes]], object] = self.sched.complete_load
        else:
            # A key no one ever stores.
            self.call = "misuse_prepare_load"
            expected = ErrorCode.MISSING
            keys = [b"X" + self.rng.randbytes(8)]
            fn = self.sched.prepare_load
        try:
            fn(keys)
        except KvdError as exc:
            if exc.code != expected and exc.code not in SESSION_LOST:
                self._violation(f"{self.call} raised {exc.code}, expected {expected}")
            return
        finally:
            self._count(self.call, None)
        if self._same(before):
            self._violation(f"{self.call} succeeded, expected {expected}")

    # -- helpers ---------------------------------------------------------------

    def _complete(
        self, call: str, fn: Callable[[], object], before: tuple[int, int] | None
    ) -> None:
        """A completion of this session's own work: it must succeed while the session lasts."""
        self._count(call, None)
        try:
            fn()
        except KvdError as exc:
            if exc.code in SESSION_LOST:
                raise
            if self._same(before):
                self._violation(f"{call} of its own work raised {exc}")
            else:  # the session changed: the daemon rolled the work back already
                self.tally.add(self.slot, "session_lost")

    def _chain(self) -> list[bytes]:
        hot = self.rng.random() < 0.8
        first = self.rng.randrange(HOT_KEYS if hot else ACTOR_KEYS)
        n = min(self.rng.randint(1, MAX_ACTOR_CHAIN), self.rng.randint(1, MAX_ACTOR_CHAIN))
        return [actor_key(first + i) for i in range(n)]

    def _hold(self) -> None:
        if self.rng.random() < 0.3:
            time.sleep(self.rng.choice((0.0005, 0.002, 0.01)))

    def _count(self, call: str, value: T) -> T:
        self.call = call
        self.tally.add(self.slot, "ops")
        return value

    def _session(self) -> tuple[int, int] | None:
        """This session's identity now; None while disconnected."""
        s = self.sched
        if not s.connected or s.attached is None or s.session_id is None:
            return None
        return (s.session_id, s.attached.generation)

    def _same(self, before: tuple[int, int] | None) -> bool:
        return before is not None and self._session() == before

    def _violation(self, detail: str) -> None:
        self.tally.violation(self.slot, f"actor: {detail}")
