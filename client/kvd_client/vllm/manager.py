"""Runs in vLLM's scheduler process: vLLM's `OffloadingManager` over kvd's index verbs.

Lookups, loads and their pins: `Lookups` (`kvd_client.vllm.lookups`); the
stores in flight: `StoresInFlight` (`kvd_client.vllm.stores`). This module
decides what a store, a completion and a reset do.

A store completes only the `prepare_store` it names (SPEC 12). vLLM
completes a store by its request and keys alone, so the manager keeps each
store in flight (`Store`: its keys, the session it was prepared in, a
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

from kvd_client.scheduler import Scheduler
from kvd_client.vllm.boundary import FailureLog
from kvd_client.vllm.lookups import (
    RETRY_WAIT_S,
    UNSERVABLE,
    KvdLoadStoreSpec,
    Lookups,
    alive_until,
)
from kvd_client.vllm.metrics import KvdCounters
from kvd_client.vllm.stores import StoresInFlight

# Names kvd_client.vllm's other modules and users import from here.
__all__ = ["RETRY_WAIT_S", "UNSERVABLE", "KvdLoadStoreSpec", "KvdOffloadingManager", "StepNotes"]
log = logging.getLogger("kvd_client.vllm")


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
        self._inflight = StoresInFlight(writers)  # workers that copy each store
        # After a cache reset offloading is off, and the session that settles the
        # orphaned stores is `_draining`; it closes when they are done.
        self._draining: Scheduler | None = None
        self._alive_handed = 0.0  # the latest `alive_until` told the workers
        self._failures = FailureLog(log)
        self._counters = KvdCounters()
        self._lookups = Lookups(scheduler, window_groups, self._counters, self._failures)
        # vLLM calls `lookup` once per key of every waiting request, every step: bound
        # straight to `Lookups`, the call costs no frame of the manager's.
        self.lookup = self._lookups.lookup  # type: ignore[method-assign]
        # What this engine stored and evicted, for vLLM's KV events; the daemon
        # publishes the whole pool's (every engine's) on its own socket.
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    @property
    def _scheduler(self) -> Scheduler | None:
        """The engine's kvd session (None: offloading off), which `Lookups` holds."""
        return self._lookups.scheduler

    @_scheduler.setter
    def _scheduler(self, scheduler: Scheduler | None) -> None:
        self._lookups.scheduler = scheduler

    # -- lookups and loads: `Lookups` --------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._lookups.lookup(key, req_context)  # bound in __init__ in its place

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self._lookups.prepare_load(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._lookups.complete_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._lookups.touch(keys, req_context)

    def on_schedule_end(self, context: object) -> None:
        self._lookups.step += 1
        if self._inflight.orphans:
            self._settle()

    # -- stores ------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """`None` (vLLM offers the blocks again next step) only when the pool has no
        room or a reconnect raced the call; with kvd off, the daemon unreachable or
        an error, the store is skipped for good: an answer of nothing to store, or
        vLLM would offer the request's blocks, more each step, and log "cannot store
        chunks" every step until the daemon is back (SPEC 12: stores are skipped)."""
        scheduler = self._scheduler
        generation = self._lookups.generation()
        if scheduler is None:
            return self._skipped(generation)
        session = self._lookups.session()
        try:
            out = scheduler.prepare_store([bytes(k) for k in keys])
        except Exception as exc:  # the boundary: nothing from kvd reaches vLLM
            self._failures.note("prepare_store", exc, "store skipped")
            self._counters.add("daemon_errors")
            return self._skipped(generation)
        if out is None:
            if not scheduler.connected:  # unreachable (the keeper reconnects)
                return self._skipped(generation)
            self._counters.add("stores_skipped")
            return None
        if not out.keys_to_store and not out.evicted_keys:
            # All there already (often answered from the ready table, with no round
            # trip): nothing held, nothing a reconnect could have taken.
            self._counters.add("stores_present")
            return PrepareStoreOutput([], KvdLoadStoreSpec([], generation), [])
        if out.evicted_keys and self._events is not None:
            self._events.append(OffloadingEvent(list(out.evicted_keys), Medium.CPU, removed=True))
        epoch, deadline = alive_until(scheduler)
        if session is None or self._lookups.session() != session or epoch != session:
            # A reconnect raced the call. What the old session prepared went with it;
            # what the new one answered lives on and would stay in flight (no
            # completion comes): it is failed here.
            if out.keys_to_store and epoch == self._lookups.session():
                try:
                    scheduler.complete_store(list(out.keys_to_store), False)
                except Exception as exc:  # the boundary; the session's end rolls it back
                    self._failures.note("complete_store", exc, "left to the daemon")
            self._counters.add("stores_skipped")
            return None
        token = 0
        if out.keys_to_store:
            token = self._inflight.add(req_context.req_id, list(out.keys_to_store), session,
                                       deadline)  # fmt: skip
        spec = KvdLoadStoreSpec(
            list(out.store_spec.slots), generation, token=token, session=session, deadline=deadline
        )
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in out.keys_to_store],
            store_spec=spec,
            evicted_keys=[OffloadKey(k) for k in out.evicted_keys],
        )

    def _skipped(self, generation: int) -> PrepareStoreOutput:
        self._counters.add("stores_skipped")
        return PrepareStoreOutput([], KvdLoadStoreSpec([], generation), [])

    def on_copies(self, copies: Mapping[int, tuple[int, bool]]) -> None:
        """The workers' reports of their store copies, `token -> (workers, all
        copied)`; `KvdOffloadingConnector` hands them over before vLLM's
        completions of the same step. A copy refused (past its deadline,
        cancelled) or failed counts as not copied."""
        self._inflight.on_copies(copies)
        if self._inflight.orphans:
            self._settle()

    def step_notes(self) -> StepNotes | None:
        """What the workers need this step (`StepNotes`); None when kvd is off."""
        scheduler = self._scheduler or self._draining
        if scheduler is None:
            return None
        session, until = alive_until(scheduler)
        self._alive_handed = max(self._alive_handed, until)
        return StepNotes(session, until, self._inflight.cancel_below)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """vLLM calls this once every rank finished a store job, naming its request
        and keys: it completes the `prepare_store` that made the job, if that was
        in this session, and makes the blocks ready if every writer copied them."""
        store = self._inflight.take(req_context.req_id, frozenset(bytes(k) for k in keys))
        if store is None or self._scheduler is None:
            return  # none in flight (vLLM dropped it, or it stored nothing), or kvd off
        if store.session != self._lookups.session():
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
        self._lookups.request_finished(req_context.req_id)

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
        return bool(self._inflight.orphans)

    def reset_cache(self) -> None:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: the pins go now, the
        stores in flight fail as soon as no worker can copy them (vLLM drops their
        completions), and offloading goes off for this engine (module docstring)."""
        self._lookups.release_pins()
        orphans = self._inflight.orphan_all(self._alive_handed)
        if self._scheduler is not None:
            log.warning(
                "kvd offloading off for this engine: vLLM reset the connector's cache "
                "(reset_prefix_cache(reset_connector=True), as after an in-place weight "
                "update), and kvd cannot tell whether the pool's KV still matches this "
                "engine's weights; it neither reads nor writes pool %r until the engine "
                "restarts (%d stores in flight failed, pins released)",
                self._scheduler.pool,
                orphans,
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

    def _settle(self, flushed: bool = False) -> None:
        """Fails the orphaned stores that no worker can copy any more (every writer
        reported, or past the last deadline a worker was told and a copy's margin,
        or all of them once vLLM says the workers `flushed` the reset's jobs), then
        closes the session of an engine whose offloading went off."""
        self._inflight.settle(self._scheduler or self._draining, self._failures, flushed)
        if not self._inflight.orphans and self._draining is not None:
            draining, self._draining = self._draining, None
            draining.close()

    def shutdown(self) -> None:
        self._lookups.release_pins()
        self._inflight.orphans.clear()
        for scheduler in (self._scheduler, self._draining):
            if scheduler is not None:
                scheduler.close()  # the daemon rolls back what is left, a lease later
        self._scheduler = self._draining = None
