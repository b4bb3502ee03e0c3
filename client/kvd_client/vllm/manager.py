"""Runs in vLLM's scheduler process: vLLM's `OffloadingManager` over kvd's index verbs.

vLLM asks `lookup(key)` once per key of every waiting request, every step.
The manager looks a request up at most once a step, at its first lookup,
from the first key vLLM asks about (those before it are in vLLM's own cache)
to the last vLLM has registered, in prefix order. Where the pool's ready
table is mapped (SPEC section 15) that costs no message, and the hits are
pinned at `prepare_load` (a block evicted meanwhile is refused there and
recomputed). Otherwise it is one round trip, which also pins the leading
hits (`Scheduler.lookup_and_pin`), so that a block another engine evicts
between lookup and load cannot be lost and `prepare_load` costs none. The pins
go with `complete_load`, or with the request (`on_request_finished`). A key
vLLM loads that holds no pin (the pins went with a reset) is pinned then; if
that fails too, the load's spec names no segment (`UNSERVABLE`), and the
workers report its blocks for vLLM to recompute.

A store completes only the `prepare_store` it names (SPEC 12). vLLM
completes a store by its request and keys alone, so the manager keeps each
store in flight (`_Store`: its keys, the session it was prepared in, a
token the workers echo) and matches the completion to it: one of an earlier
session (a reconnect, a daemon restarted, a lease rolled back) completes
nothing, and a store becomes ready only if every worker that copies it
reported the copy done (`on_copies`, from `KvdOffloadingConnector`). Each
spec carries a deadline: no worker starts a copy past it, since by then the
daemon may have given the slots to other blocks (a session's holdings
outlive the last request the daemon answered by two leases; the deadline
is one lease after it, renewed each step by `step_notes`).

vLLM's `reset_cache` (`reset_prefix_cache(reset_connector=True)`, also a
pause that clears caches) drops the completions of the stores in flight:
they fail here as soon as no worker can copy them any more (every writer
reported, or past their deadline), so no lookup waits on them, and the pins
go at once. Since such a reset is how vLLM clears caches after an in-place
weight update, which kvd cannot see, the engine then stops reading and
writing the pool (one log line) until it restarts: it never loads KV of
weights it no longer has.

kvd never breaks vLLM: a daemon that is down, slow or refusing costs misses
and skipped stores, never an exception into the scheduler; each failure
is one log line, at most one a kind every `FailureLog` interval.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvd_client.scheduler import Scheduler
from kvd_client.vllm.boundary import FailureLog
from kvd_client.vllm.groups import group_of, lookup_order
from kvd_client.vllm.metrics import KvdCounters
from kvd_client.vllm.records import Pin as _Pin
from kvd_client.vllm.records import Request as _Request
from kvd_client.vllm.records import Store as _Store

log = logging.getLogger("kvd_client.vllm")
UNSERVABLE = -1  # the generation of a load spec whose slots kvd could not pin
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_NO_GROUPS: dict[int, _Request] = {}  # a request not looked up (never written to)
# Round trips a window group's scan back may add in one step past the first
# miss, without the ready table (`_scan_on`): vLLM stores a sliding group's
# chunks only up to its prompt's last full chunk, so the chunk its lookup
# starts from is often missing and the window is just before it.
SCAN_TRIPS = 4


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


COPY_MARGIN_S = 1.0  # a copy started before its deadline has ended by this much after
# How long a lookup answers RETRY (a key being stored or fetched) before a miss.
# vLLM's scheduler asks again every step, so a waiting request spins the engine
# loop: with two engines on one host, one waiting out the other's stores for
# seconds starved the other of the CPU (`kvd bench peers`, two_engines: TTFT
# 5.5 s against 0.46 s with no connector). A prefix not stored by then is
# recomputed, which is what an engine without kvd does anyway.
RETRY_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class StepNotes:
    """What the scheduler side tells its workers each step (`KvdConnectorMetadata`):
    session `session` holds its slots until `alive_until` (monotonic; a copy of it
    may start until then, later than its spec's deadline), and no store with a
    token below `cancel_below` may be copied (vLLM reset the cache since)."""

    session: int
    alive_until: float
    cancel_below: int


class KvdOffloadingManager(OffloadingManager):
    def __init__(
        self,
        scheduler: Scheduler | None,
        *,
        enable_events: bool = False,
        writers: int = 1,
        window_groups: Collection[int] = (),
    ) -> None:
        self._scheduler = scheduler  # None: offloading off for this engine
        self._writers = writers  # workers that copy each store
        # Groups vLLM looks up scanning back for a window (`kvd_client.vllm.groups`).
        self._window_groups = frozenset(window_groups)
        # Stores in flight by (request, keys), the oldest first, and by token.
        self._stores: dict[tuple[str, frozenset[bytes]], deque[_Store]] = {}
        self._by_token: dict[int, _Store] = {}
        self._next_token = 1
        # Stores whose completions vLLM dropped (a cache reset): failed once no
        # worker can copy them any more. Meanwhile offloading is off, and the
        # session that settles them is `_draining`; it closes when they are done.
        self._orphans: dict[int, _Store] = {}
        self._draining: Scheduler | None = None
        self._cancel_below = 0  # no store with a lower token may be copied
        self._alive_handed = 0.0  # the latest `alive_until` told the workers
        self._alive_at_reset = 0.0
        self._failures = FailureLog(log)
        self._requests: dict[str, dict[int, _Request]] = {}  # request -> group -> lookup
        self._step = 0  # scheduler steps so far (`on_schedule_end`)
        self._counters = KvdCounters()
        self._warned_no_pin = False
        # What this engine stored and evicted, for vLLM's KV events; the daemon
        # publishes the whole pool's (every engine's) on its own socket.
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    # -- lookups ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        state = self._requests.get(req_context.req_id, _NO_GROUPS).get(group_of(key))
        if state is not None and state.step == self._step:
            hit_keys = state.hit_keys
            if hit_keys is not None and type(key) is bytes:
                # Looked up in the ready table this step: vLLM asks key by key.
                if key in hit_keys:
                    return _HIT
                if state.scanned is None or key in state.scanned:
                    return _MISS
        return self._lookup(bytes(key), req_context, state)

    def _lookup(self, key: bytes, req_context: ReqContext, state: _Request | None) -> LookupResult:
        if self._scheduler is None:
            return LookupResult.MISS
        if state is None or (state.step != self._step and self._stale(state, key, req_context)):
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
        return LookupResult.HIT if pin is not None and self._valid(pin) else LookupResult.MISS

    def _retry(self, state: _Request, ctx: ReqContext) -> LookupResult:
        """RETRY while a key is being stored or fetched, for `RETRY_WAIT_S` (two
        leases if shorter) at most: a store whose owner is slow, stuck (its session
        still alive) or leaked would hold the request, and vLLM has no timeout on
        RETRY. Then MISS: vLLM recomputes, and its own store of those keys skips
        them."""
        now = time.monotonic()
        if state.retry_since is None:
            state.retry_since = now
        lease = self._scheduler.lease_s if self._scheduler is not None else 0.0
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
            or any(not self._valid(pin) for pin in state.pinned.values())
        )

    def on_schedule_end(self, context: object) -> None:
        self._step += 1
        if self._orphans:
            self._settle()

    def _session(self) -> int | None:
        """This session with the daemon (`Scheduler.epoch`); None while disconnected."""
        if self._scheduler is None or not self._scheduler.connected:
            return None
        return self._scheduler.epoch

    def _valid(self, pin: _Pin) -> bool:
        """A pin of another session (the plug-in reconnected since) may be gone."""
        return pin.session is not None and pin.session == self._session()

    def _look_up(self, ctx: ReqContext, old: _Request | None, first: bytes) -> _Request:
        assert self._scheduler is not None
        if old is not None:
            self._unpin(old, list(old.pinned))
        positions: dict[bytes, int] = getattr(ctx, "_offload_key_positions", {})
        # The keys of `first`'s group in the order vLLM's scan reads them (forward,
        # or back for a window group); for a prefix group those before `first` are
        # in vLLM's own cache.
        group = group_of(first)
        window = group in self._window_groups
        keys = lookup_order(positions, first, window=window)
        state = _Request(keys, len(positions), self._step)
        if old is not None and old.hits is None:  # still waiting on the same stores
            state.retry_since = old.retry_since
        self._requests.setdefault(ctx.req_id, {})[group] = state
        self._counters.add("lookup_keys", len(keys))
        if self._scheduler.table is not None:  # no round trip: pinned at prepare_load
            hits = state.hits = self._scheduler.lookup(keys)
            state.from_table = True
            state.failed = not self._scheduler.connected
            if hits is not None:
                state.hit_keys = frozenset(keys[:hits])
                if window:
                    state.scanned = set(keys[: hits + 1])
            self._counters.add("lookup_hit_keys", hits or 0)
            return state
        state.index = dict(zip(keys, range(len(keys)), strict=True))
        self._counters.add("lookup_rpcs")
        try:
            hits, spec = self._scheduler.lookup_and_pin(keys)  # one round trip
        except Exception as exc:  # the boundary: the pin cap, a reset, the daemon refusing
            log.info("kvd lookup of request %s answered as a miss: %s", ctx.req_id, exc)
            self._counters.add("daemon_errors")
            state.failed = True
            return state
        if not self._scheduler.connected:
            state.failed = True  # answered 0 without asking: try again next step
        state.hits = hits
        if hits and len(spec.slots) != hits:  # a daemon that does not pin at lookup
            if not self._warned_no_pin:
                log.warning("kvd daemon did not pin the hits it found (older than the client?)")
                self._warned_no_pin = True
            if spec.slots:
                try:
                    self._scheduler.complete_load(keys[: len(spec.slots)])
                except Exception as exc:  # the boundary: the daemon rolls them back
                    self._failures.note("complete_load", exc, "pins left to the daemon")
            state.hits = 0
            return state
        if hits:
            generation, session = self._generation(), self._session()
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
        assert self._scheduler is not None and state.scanned is not None
        positions: dict[bytes, int] = getattr(ctx, "_offload_key_positions", {})
        keys = lookup_order(positions, key, window=True)
        if not state.from_table:
            if state.scan_trips <= 0:
                state.scanned.add(key)
                return
            state.scan_trips -= 1
            state.scanned.update(keys[: self._pin_run(state, keys) + 1])
            return
        hits = self._scheduler.lookup(keys) or 0
        state.scanned.update(keys[: hits + 1])
        state.hit_keys = (state.hit_keys or frozenset()) | frozenset(keys[:hits])
        self._counters.add("lookup_keys", len(keys))
        self._counters.add("lookup_hit_keys", hits)

    def _pin_run(self, state: _Request, keys: list[bytes]) -> int:
        """One round trip that pins the leading ready keys of `keys` into `state`;
        how many (0 where the daemon refuses, or a key is being stored)."""
        assert self._scheduler is not None
        self._counters.add("lookup_rpcs")
        self._counters.add("lookup_keys", len(keys))
        try:
            hits, spec = self._scheduler.lookup_and_pin(keys)
        except Exception as exc:  # the boundary: the rest of the scan reads as misses
            log.info("kvd lookup answered as a miss: %s", exc)
            self._counters.add("daemon_errors")
            return 0
        if not hits or len(spec.slots) != hits:  # None, 0, or a daemon that does not pin
            if spec.slots:
                self._unpin_slots(keys[: len(spec.slots)])
            return 0
        generation, session = self._generation(), self._session()
        for key, slot in zip(keys[:hits], spec.slots, strict=True):
            state.pinned[key] = _Pin(slot, generation, session)
            state.index.setdefault(key, len(state.index))
        self._counters.add("lookup_hit_keys", hits)
        return hits

    def _unpin_slots(self, keys: list[bytes]) -> None:
        assert self._scheduler is not None
        try:
            self._scheduler.complete_load(keys)
        except Exception as exc:  # the boundary: the daemon rolls them back
            self._failures.note("complete_load", exc, "pins left to the daemon")

    # -- loads -------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        wanted = [bytes(k) for k in keys]  # group by group, as vLLM's blocks are
        states = self._requests.setdefault(req_context.req_id, {})
        if not wanted:
            return KvdLoadStoreSpec([], self._generation())
        of = [states.get(g) or states.setdefault(g, _Request([], 0, self._step))
              for g in map(group_of, wanted)]  # fmt: skip
        # Pins vLLM will not load (its own cache has those blocks) go now.
        loading = set(wanted)  # once: a long prompt loads 10^5 keys
        for state in states.values():
            self._unpin(state, [k for k in state.pinned if k not in loading])
        pins = [state.pinned.get(k) for k, state in zip(wanted, of, strict=True)]
        if (
            any(pin is None or not self._valid(pin) for pin in pins)
            or len({pin.generation for pin in pins if pin is not None}) > 1
        ):  # one spec names one segment, pinned by this session
            for state in states.values():
                self._unpin(state, list(state.pinned))  # all of them are keys vLLM loads
            if not self._pin(of, wanted):
                self._counters.add("unservable_loads")
                return KvdLoadStoreSpec([0] * len(wanted), UNSERVABLE)
        got = [state.pinned[k] for k, state in zip(wanted, of, strict=True)]
        session, until = self._alive_until(self._scheduler)
        return KvdLoadStoreSpec(
            [pin.slot for pin in got], got[0].generation, session=session, deadline=until
        )

    def _pin(self, states: list[_Request], keys: list[bytes]) -> bool:
        """Pins `keys` (the lookup of `states[i]` holds `keys[i]`), which vLLM loads
        without a valid pin (a reset or a reconnect took it): true if they are now
        pinned, all in the pool's current segment."""
        if self._scheduler is None:
            return False
        try:
            spec = self._scheduler.prepare_load(keys)
        except Exception as exc:  # the boundary: a refusal, a reset, the daemon down
            log.info("kvd cannot serve a load vLLM asked for, recomputed: %s", exc)
            self._counters.add("daemon_errors")
            return False
        generation, session = self._generation(), self._session()
        for key, slot, state in zip(keys, spec.slots, states, strict=True):
            state.pinned[key] = _Pin(slot, generation, session)
        return True

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        done = {bytes(k) for k in keys}
        for state in self._requests.get(req_context.req_id, _NO_GROUPS).values():
            self._unpin(state, [k for k in state.pinned if k in done], wait=False)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.touch([bytes(k) for k in keys], wait=False)
            except Exception as exc:  # the boundary: nothing from kvd reaches vLLM
                self._failures.note("touch", exc, "skipped")

    def _generation(self) -> int:
        attached = self._scheduler.attached if self._scheduler is not None else None
        return attached.generation if attached is not None else 0

    @staticmethod
    def _alive_until(scheduler: Scheduler | None) -> tuple[int, float]:
        """`(epoch, t)`: until monotonic t a worker may start copying what session
        `epoch` holds. The daemon answered that session a request sent a lease
        before t, so it ends a lease after t at the earliest, and what it holds
        one lease later still: a copy started by t has a lease to finish."""
        if scheduler is None:
            return 0, 0.0
        epoch, since = scheduler.alive_since()
        return epoch, since + scheduler.lease_s

    def _unpin(self, state: _Request, keys: list[bytes], *, wait: bool = True) -> None:
        """Releases the pins of `keys`; those of an earlier session the daemon rolls
        back. `wait=False` (a load done, every step with a hit): not waited for."""
        mine = [k for k in keys if k in state.pinned and self._valid(state.pinned[k])]
        for key in keys:
            state.pinned.pop(key, None)
        if not mine or self._scheduler is None:
            return
        try:
            self._scheduler.complete_load(mine, wait=wait)
        except Exception as exc:  # the boundary: a reset or a reconnect took the pins already
            log.debug("kvd complete_load skipped: %s", exc)

    # -- stores ------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        scheduler = self._scheduler
        if scheduler is None:
            return None
        session, generation = self._session(), self._generation()
        try:
            out = scheduler.prepare_store([bytes(k) for k in keys])
        except Exception as exc:  # the boundary: nothing from kvd reaches vLLM
            self._failures.note("prepare_store", exc, "store skipped")
            self._counters.add("daemon_errors")
            self._counters.add("stores_skipped")
            return None
        if out is None:
            self._counters.add("stores_skipped")
            return None
        if not out.keys_to_store and not out.evicted_keys:
            # All there already (often answered from the ready table, with no round
            # trip): nothing held, nothing a reconnect could have taken.
            self._counters.add("stores_present")
            return PrepareStoreOutput([], KvdLoadStoreSpec([], generation), [])
        if out.evicted_keys and self._events is not None:
            self._events.append(OffloadingEvent(list(out.evicted_keys), Medium.CPU, removed=True))
        epoch, deadline = self._alive_until(scheduler)
        if session is None or self._session() != session or epoch != session:
            # A reconnect raced the call. What the old session prepared went with it;
            # what the new one answered lives on and would stay in flight (no
            # completion comes): it is failed here.
            if out.keys_to_store and epoch == self._session():
                try:
                    scheduler.complete_store(list(out.keys_to_store), False)
                except Exception as exc:  # the boundary; the session's end rolls it back
                    self._failures.note("complete_store", exc, "left to the daemon")
            self._counters.add("stores_skipped")
            return None
        token = 0
        if out.keys_to_store:
            token, self._next_token = self._next_token, self._next_token + 1
            store = _Store(token, list(out.keys_to_store), session, deadline, self._writers)
            self._stores.setdefault((req_context.req_id, frozenset(store.keys)), deque()).append(
                store
            )
            self._by_token[token] = store
        spec = KvdLoadStoreSpec(
            list(out.store_spec.slots), generation, token=token, session=session, deadline=deadline
        )
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in out.keys_to_store],
            store_spec=spec,
            evicted_keys=[OffloadKey(k) for k in out.evicted_keys],
        )

    def on_copies(self, copies: Mapping[int, tuple[int, bool]]) -> None:
        """The workers' reports of their store copies, `token -> (workers, all
        copied)`; `KvdOffloadingConnector` hands them over before vLLM's
        completions of the same step. A copy refused (past its deadline,
        cancelled) or failed counts as not copied."""
        for token, (workers, copied) in copies.items():
            store = self._by_token.get(token) or self._orphans.get(token)
            if store is not None:
                store.reports += workers
                store.copied = store.copied and copied
        if self._orphans:
            self._settle()

    def step_notes(self) -> StepNotes | None:
        """What the workers need this step (`StepNotes`); None when kvd is off."""
        scheduler = self._scheduler or self._draining
        if scheduler is None:
            return None
        session, until = self._alive_until(scheduler)
        self._alive_handed = max(self._alive_handed, until)
        return StepNotes(session, until, self._cancel_below)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """vLLM calls this once every rank finished a store job, naming its request
        and keys: it completes the `prepare_store` that made the job, if that was
        in this session, and makes the blocks ready if every writer copied them."""
        found = self._stores.get((req_context.req_id, frozenset(bytes(k) for k in keys)))
        if not found:
            return  # none in flight (vLLM dropped it, or it stored nothing)
        store = found.popleft()
        if not found:
            del self._stores[(req_context.req_id, frozenset(store.keys))]
        del self._by_token[store.token]
        if self._scheduler is None:
            return
        if store.session != self._session():
            # Prepared in a session that ended (its stores went with it): if the
            # same keys were prepared again since, that store is not this one.
            self._counters.add("stale_completions")
            self._failures.note(
                "store completion", f"prepared in session {store.session}", "completed nothing"
            )
            return
        ok = success and store.copied and store.reports >= store.writers
        try:
            accepted = self._scheduler.complete_store(store.keys, ok)
        except Exception as exc:  # the boundary: the store stays unready
            self._failures.note("complete_store", exc, "store left unready")
            accepted = False
        if not accepted:
            self._counters.add("daemon_errors")
            return
        if not ok:
            self._counters.add("stores_failed")
            self._failures.note(
                "store copy", f"{store.reports} of {store.writers} workers copied it",
                "store completed as failed",
            )  # fmt: skip
            return
        self._counters.add("stored_keys", len(store.keys))
        if self._events is not None:
            self._events.append(
                OffloadingEvent([OffloadKey(k) for k in store.keys], Medium.CPU, removed=False)
            )

    # -- requests and steps ------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        for state in self._requests.pop(req_context.req_id, _NO_GROUPS).values():
            self._unpin(state, list(state.pinned))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._counters.take()

    def has_pending_work(self) -> bool:
        """Stores to settle after a reset: vLLM keeps stepping, so the workers flush
        them and report."""
        return bool(self._orphans)

    def reset_cache(self) -> None:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: the pins go now, the
        stores in flight fail as soon as no worker can copy them (vLLM drops their
        completions), and offloading goes off for this engine (module docstring)."""
        self._release_pins()
        for queue in self._stores.values():
            for store in queue:
                self._orphans[store.token] = store
        self._stores.clear()
        self._by_token.clear()
        self._cancel_below = self._next_token
        self._alive_at_reset = self._alive_handed
        if self._scheduler is not None:
            log.warning(
                "kvd offloading off for this engine: vLLM reset the connector's cache "
                "(reset_prefix_cache(reset_connector=True), as after an in-place weight "
                "update), and kvd cannot tell whether the pool's KV still matches this "
                "engine's weights; it neither reads nor writes pool %r until the engine "
                "restarts (%d stores in flight failed, pins released)",
                self._scheduler.pool,
                len(self._orphans),
            )
            self._draining, self._scheduler = self._scheduler, None
        self._settle()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every worker has reported every job in flight at the last
        `reset_cache`, so no worker copies an orphaned store any more: they fail now,
        not at their deadline (vLLM 0.32, which never calls this, waits for that)."""
        self._settle(flushed=True)

    # vLLM 0.33's other manager hooks keep their defaults. `lock` (a no-op): only
    # vLLM's scheduler thread enters this manager; the kvd `Scheduler`'s own thread
    # shares nothing with it but what the `Scheduler` locks itself. `config_info`
    # (no labels, as the spec's `config_info_keys` declares none): the facts it
    # would carry, the pool's size and slots, are the daemon's, set by whichever
    # engine created the pool and renewed by a cold restart, not fixed for this
    # process as the info metric requires; the daemon exports them
    # (`kvd_pool_capacity_bytes`, `kvd_pool_capacity_blocks`).

    def _release_pins(self) -> None:
        for states in self._requests.values():
            for state in states.values():
                self._unpin(state, list(state.pinned))
        self._requests.clear()

    def _settle(self, flushed: bool = False) -> None:
        """Fails the orphaned stores that no worker can copy any more (every writer
        reported, or past the last deadline a worker was told and a copy's margin,
        or all of them once vLLM says the workers `flushed` the reset's jobs), then
        closes the session of an engine whose offloading went off."""
        scheduler = self._scheduler or self._draining
        connected = scheduler is not None and scheduler.connected
        current = scheduler.epoch if scheduler is not None and connected else None
        now = time.monotonic()
        for token, store in list(self._orphans.items()):
            copying = store.session == current and store.reports < store.writers
            if (
                copying
                and not flushed
                and now < max(store.deadline, self._alive_at_reset) + COPY_MARGIN_S
            ):
                continue  # a worker may still copy it
            del self._orphans[token]
            if store.session != current or scheduler is None:
                continue  # it went with its session
            try:
                scheduler.complete_store(store.keys, False)
            except Exception as exc:  # the boundary
                self._failures.note("complete_store", exc, "left to the daemon's rollback")
        if not self._orphans and self._draining is not None:
            draining, self._draining = self._draining, None
            draining.close()

    def shutdown(self) -> None:
        self._release_pins()
        self._orphans.clear()
        for scheduler in (self._scheduler, self._draining):
            if scheduler is not None:
                scheduler.close()  # the daemon rolls back what is left, a lease later
        self._scheduler = self._draining = None
