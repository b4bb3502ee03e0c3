"""Runs in vLLM's scheduler process: the manager's lookups of waiting requests and their pins.

vLLM asks `lookup(key)` once per key of every waiting request, every step.
A request is looked up at most once a step, at its first lookup, from the
first key vLLM asks about (those before it are in vLLM's own cache) to the
last vLLM has registered, in prefix order. Where the pool's ready table is
mapped (SPEC section 15) that costs no message, and the hits are pinned at
`prepare_load` (a block evicted meanwhile is refused there and recomputed).
Otherwise it is one round trip, which also pins the leading hits
(`Scheduler.lookup_and_pin`), so that a block another engine evicts between
lookup and load cannot be lost and `prepare_load` costs none. The pins go
with `complete_load`, or with the request (`request_finished`). A key vLLM
loads that holds no pin (the pins went with a reset) is pinned then; if that
fails too, the load's spec names no segment (`UNSERVABLE`), and the workers
report its blocks for vLLM to recompute.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection

from vllm.v1.kv_offload.base import LoadStoreSpec, LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvd_client.scheduler import Scheduler
from kvd_client.vllm.boundary import FailureLog
from kvd_client.vllm.groups import group_of, lookup_order
from kvd_client.vllm.metrics import KvdCounters
from kvd_client.vllm.records import Pin as _Pin
from kvd_client.vllm.records import Request as _Request

log = logging.getLogger("kvd_client.vllm")
UNSERVABLE = -1  # the generation of a load spec whose slots kvd could not pin
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_NO_GROUPS: dict[int, _Request] = {}  # a request not looked up (never written to)
# Round trips a window group's scan back may add in one step past the first
# miss, without the ready table (`_scan_on`): vLLM stores a sliding group's
# chunks only up to its prompt's last full chunk, so the chunk its lookup
# starts from is often missing and the window is just before it.
SCAN_TRIPS = 4
# How long a lookup answers RETRY (a key being stored or fetched) before a miss.
# vLLM's scheduler asks again every step, so a waiting request spins the engine
# loop: with two engines on one host, one waiting out the other's stores for
# seconds starved the other of the CPU (`kvd bench peers`, two_engines: TTFT
# 5.5 s against 0.46 s with no connector). A prefix not stored by then is
# recomputed, which is what an engine without kvd does anyway.
RETRY_WAIT_S = 0.5


class KvdLoadStoreSpec(CPULoadStoreSpec):
    """kvd slot ids, and the generation of the pool's segment they are slots of.

    A daemon restarted cold re-creates the pool; the workers keep the previous
    segment mapped, so a load pinned before the restart still reads the bytes
    it was promised, and a store meant for it never lands in the new one.
    """

    def __init__(
        self,
        slots: list[int],
        generation: int,
        *,
        token: int = 0,
        session: int = 0,
        deadline: float = math.inf,
    ) -> None:
        super().__init__(slots)
        self.generation = generation
        self.token = token  # a store's: names its prepare_store (0: a load)
        self.session = session  # the `Scheduler.epoch` that holds the slots
        self.deadline = deadline  # monotonic: no worker starts the copy later


def alive_until(scheduler: Scheduler | None) -> tuple[int, float]:
    """`(epoch, t)`: until monotonic t a worker may start copying what session
    `epoch` holds. The daemon answered that session a request sent a lease
    before t, so it ends a lease after t at the earliest, and what it holds
    one lease later still: a copy started by t has a lease to finish."""
    if scheduler is None:
        return 0, 0.0
    epoch, since = scheduler.alive_since()
    return epoch, since + scheduler.lease_s


class Lookups:
    """The lookups and pins of one engine's requests, by request and KV cache group."""

    def __init__(
        self,
        scheduler: Scheduler | None,
        window_groups: Collection[int],
        counters: KvdCounters,
        failures: FailureLog,
    ) -> None:
        self.scheduler = scheduler  # None: offloading off for this engine
        # Groups vLLM looks up scanning back for a window (`kvd_client.vllm.groups`).
        self._window_groups = frozenset(window_groups)
        self._counters = counters
        self._failures = failures
        self.requests: dict[str, dict[int, _Request]] = {}  # request -> group -> lookup
        self.step = 0  # scheduler steps so far (`KvdOffloadingManager.on_schedule_end`)
        self._warned_no_pin = False

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self.requests.get(req_context.req_id, _NO_GROUPS).get(group_of(key))
        if state is not None and state.step == self.step:
            hit_keys = state.hit_keys
            if hit_keys is not None and type(key) is bytes:
                # Looked up in the ready table this step: vLLM asks key by key.
                if key in hit_keys:
                    return _HIT
                if state.scanned is None or key in state.scanned:
                    return _MISS
        return self._lookup(bytes(key), req_context, state)

    def _lookup(self, key: bytes, req_context: ReqContext, state: _Request | None) -> LookupResult:
        if self.scheduler is None:
            return LookupResult.MISS
        if state is None or (state.step != self.step and self._stale(state, key, req_context)):
            # Once per request, group and step at most (a window group's scan
            # past a miss: again from the ready table, `_scan_on`).
            state = self._look_up(req_context, state, key)
        elif state.scanned is not None and key not in state.scanned:
            self._scan_on(state, key, req_context)
        if state.hits is None:
            return self._retry(state, req_context)
        if state.hit_keys is not None:  # from the ready table
            return LookupResult.HIT if key in state.hit_keys else LookupResult.MISS
        if state.from_table:  # hits None: answered RETRY above
            return LookupResult.MISS
        pin = state.pinned.get(key)
        return LookupResult.HIT if pin is not None and self.valid(pin) else LookupResult.MISS

    def _retry(self, state: _Request, ctx: ReqContext) -> LookupResult:
        """RETRY while a key is being stored or fetched, for `RETRY_WAIT_S` (two
        leases if shorter) at most: a store whose owner is slow, stuck (its session
        still alive) or leaked would hold the request, and vLLM has no timeout on
        RETRY. Then MISS: vLLM recomputes, and its own store of those keys skips
        them."""
        now = time.monotonic()
        if state.retry_since is None:
            state.retry_since = now
        lease = self.scheduler.lease_s if self.scheduler is not None else 0.0
        bound = min(2 * lease, RETRY_WAIT_S)
        if now - state.retry_since <= bound:
            return LookupResult.RETRY
        if state.hits is None:  # once per request and episode
            self._counters.add("retries_given_up")
            self._failures.note(
                "lookup", f"request {ctx.req_id} waited {bound:.1f} s", "recomputed"
            )
        state.hits, state.hit_keys = 0, frozenset()
        return LookupResult.MISS

    def _stale(self, state: _Request, key: bytes, ctx: ReqContext) -> bool:
        """Whether a new step should look the request up again."""
        registered = len(getattr(ctx, "_offload_key_positions", ()))
        return (
            state.from_table  # a table lookup costs no message: always fresh
            or state.hits is None
            or state.failed
            or registered != state.registered
            or key not in state.index
            or any(not self.valid(pin) for pin in state.pinned.values())
        )

    def session(self) -> int | None:
        """This session with the daemon (`Scheduler.epoch`); None while disconnected."""
        if self.scheduler is None or not self.scheduler.connected:
            return None
        return self.scheduler.epoch

    def valid(self, pin: _Pin) -> bool:
        """A pin of another session (the plug-in reconnected since) may be gone."""
        return pin.session is not None and pin.session == self.session()

    def _look_up(self, ctx: ReqContext, old: _Request | None, first: bytes) -> _Request:
        assert self.scheduler is not None
        if old is not None:
            self.unpin(old, list(old.pinned))
        positions: dict[bytes, int] = getattr(ctx, "_offload_key_positions", {})
        # The keys of `first`'s group in the order vLLM's scan reads them (forward,
        # or back for a window group); for a prefix group those before `first` are
        # in vLLM's own cache.
        group = group_of(first)
        window = group in self._window_groups
        keys = lookup_order(positions, first, window=window)
        state = _Request(keys, len(positions), self.step)
        if old is not None and old.hits is None:  # still waiting on the same stores
            state.retry_since = old.retry_since
        self.requests.setdefault(ctx.req_id, {})[group] = state
        self._counters.add("lookup_keys", len(keys))
        if self.scheduler.table is not None:  # no round trip: pinned at prepare_load
            hits = state.hits = self.scheduler.lookup(keys)
            state.from_table = True
            state.failed = not self.scheduler.connected
            if hits is not None:
                state.hit_keys = frozenset(keys[:hits])
                if window:
                    state.scanned = set(keys[: hits + 1])
            self._counters.add("lookup_hit_keys", hits or 0)
            return state
        state.index = dict(zip(keys, range(len(keys)), strict=True))
        self._counters.add("lookup_rpcs")
        try:
            hits, spec = self.scheduler.lookup_and_pin(keys)  # one round trip
        except Exception as exc:  # the boundary: the pin cap, a reset, the daemon refusing
            log.info("kvd lookup of request %s answered as a miss: %s", ctx.req_id, exc)
            self._counters.add("daemon_errors")
            state.failed = True
            return state
        if not self.scheduler.connected:
            state.failed = True  # answered 0 without asking: try again next step
        state.hits = hits
        if hits and len(spec.slots) != hits:  # a daemon that does not pin at lookup
            if not self._warned_no_pin:
                log.warning("kvd daemon did not pin the hits it found (older than the client?)")
                self._warned_no_pin = True
            if spec.slots:
                try:
                    self.scheduler.complete_load(keys[: len(spec.slots)])
                except Exception as exc:  # the boundary: the daemon rolls them back
                    self._failures.note("complete_load", exc, "pins left to the daemon")
            state.hits = 0
            return state
        if hits:
            generation, session = self.generation(), self.session()
            for key, slot in zip(keys[:hits], spec.slots, strict=True):
                state.pinned[key] = _Pin(slot, generation, session)
            self._counters.add("lookup_hit_keys", hits)
        if window and hits is not None:  # vLLM's scan back goes on past a miss
            state.scanned, state.scan_trips = set(keys[: hits + 1]), SCAN_TRIPS
        return state

    def _scan_on(self, state: _Request, key: bytes, ctx: ReqContext) -> None:
        """vLLM's scan back over a window group went on past the miss that ended
        the run found this step: the run from `key` back, from the ready table
        (no message), or over a round trip that pins it, `SCAN_TRIPS` at most a
        step (then a miss). A key being stored reads as a miss, and is recomputed."""
        assert self.scheduler is not None and state.scanned is not None
        positions: dict[bytes, int] = getattr(ctx, "_offload_key_positions", {})
        keys = lookup_order(positions, key, window=True)
        if not state.from_table:
            if state.scan_trips <= 0:
                state.scanned.add(key)
                return
            state.scan_trips -= 1
            state.scanned.update(keys[: self._pin_run(state, keys) + 1])
            return
        hits = self.scheduler.lookup(keys) or 0
        state.scanned.update(keys[: hits + 1])
        state.hit_keys = (state.hit_keys or frozenset()) | frozenset(keys[:hits])
        self._counters.add("lookup_keys", len(keys))
        self._counters.add("lookup_hit_keys", hits)

    def _pin_run(self, state: _Request, keys: list[bytes]) -> int:
        """One round trip that pins the leading ready keys of `keys` into `state`;
        how many (0 where the daemon refuses, or a key is being stored)."""
        assert self.scheduler is not None
        self._counters.add("lookup_rpcs")
        self._counters.add("lookup_keys", len(keys))
        try:
            hits, spec = self.scheduler.lookup_and_pin(keys)
        except Exception as exc:  # the boundary: the rest of the scan reads as misses
            log.info("kvd lookup answered as a miss: %s", exc)
            self._counters.add("daemon_errors")
            return 0
        if not hits or len(spec.slots) != hits:  # None, 0, or a daemon that does not pin
            if spec.slots:
                self._unpin_slots(keys[: len(spec.slots)])
            return 0
        generation, session = self.generation(), self.session()
        for key, slot in zip(keys[:hits], spec.slots, strict=True):
            state.pinned[key] = _Pin(slot, generation, session)
            state.index.setdefault(key, len(state.index))
        self._counters.add("lookup_hit_keys", hits)
        return hits

    def _unpin_slots(self, keys: list[bytes]) -> None:
        assert self.scheduler is not None
        try:
            self.scheduler.complete_load(keys)
        except Exception as exc:  # the boundary: the daemon rolls them back
            self._failures.note("complete_load", exc, "pins left to the daemon")

    # -- loads -----------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        wanted = [bytes(k) for k in keys]  # group by group, as vLLM's blocks are
        states = self.requests.setdefault(req_context.req_id, {})
        if not wanted:
            return KvdLoadStoreSpec([], self.generation())
        of = [states.get(g) or states.setdefault(g, _Request([], 0, self.step))
              for g in map(group_of, wanted)]  # fmt: skip
        # Pins vLLM will not load (its own cache has those blocks) go now.
        loading = set(wanted)  # once: a long prompt loads 10^5 keys
        for state in states.values():
            self.unpin(state, [k for k in state.pinned if k not in loading])
        pins = [state.pinned.get(k) for k, state in zip(wanted, of, strict=True)]
        if (
            any(pin is None or not self.valid(pin) for pin in pins)
            or len({pin.generation for pin in pins if pin is not None}) > 1
        ):  # one spec names one segment, pinned by this session
            for state in states.values():
                self.unpin(state, list(state.pinned))  # all of them are keys vLLM loads
            if not self._pin(of, wanted):
                self._counters.add("unservable_loads")
                return KvdLoadStoreSpec([0] * len(wanted), UNSERVABLE)
        got = [state.pinned[k] for k, state in zip(wanted, of, strict=True)]
        session, until = alive_until(self.scheduler)
        return KvdLoadStoreSpec(
            [pin.slot for pin in got], got[0].generation, session=session, deadline=until
        )

    def _pin(self, states: list[_Request], keys: list[bytes]) -> bool:
        """Pins `keys` (the lookup of `states[i]` holds `keys[i]`), which vLLM loads
        without a valid pin (a reset or a reconnect took it): true if they are now
        pinned, all in the pool's current segment."""
        if self.scheduler is None:
            return False
        try:
            spec = self.scheduler.prepare_load(keys)
        except Exception as exc:  # the boundary: a refusal, a reset, the daemon down
            log.info("kvd cannot serve a load vLLM asked for, recomputed: %s", exc)
            self._counters.add("daemon_errors")
            return False
        generation, session = self.generation(), self.session()
        for key, slot, state in zip(keys, spec.slots, states, strict=True):
            state.pinned[key] = _Pin(slot, generation, session)
        return True

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        done = {bytes(k) for k in keys}
        for state in self.requests.get(req_context.req_id, _NO_GROUPS).values():
            self.unpin(state, [k for k in state.pinned if k in done], wait=False)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self.scheduler is not None:
            try:
                self.scheduler.touch([bytes(k) for k in keys], wait=False)
            except Exception as exc:  # the boundary: nothing from kvd reaches vLLM
                self._failures.note("touch", exc, "skipped")

    def generation(self) -> int:
        attached = self.scheduler.attached if self.scheduler is not None else None
        return attached.generation if attached is not None else 0

    def unpin(self, state: _Request, keys: list[bytes], *, wait: bool = True) -> None:
        """Releases the pins of `keys`; those of an earlier session the daemon rolls
        back. `wait=False` (a load done, every step with a hit): not waited for."""
        mine = [k for k in keys if k in state.pinned and self.valid(state.pinned[k])]
        for key in keys:
            state.pinned.pop(key, None)
        if not mine or self.scheduler is None:
            return
        try:
            self.scheduler.complete_load(mine, wait=wait)
        except Exception as exc:  # the boundary: a reset or a reconnect took the pins already
            log.debug("kvd complete_load skipped: %s", exc)

    def request_finished(self, req_id: str) -> None:
        for state in self.requests.pop(req_id, _NO_GROUPS).values():
            self.unpin(state, list(state.pinned))

    def release_pins(self) -> None:
        for states in self.requests.values():
            for state in states.values():
                self.unpin(state, list(state.pinned))
        self.requests.clear()
