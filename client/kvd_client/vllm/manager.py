"""Runs in vLLM's scheduler process: vLLM's `OffloadingManager` over kvd's index verbs.

vLLM asks `lookup(key)` once per key of every waiting request, every step.
The manager answers a request's keys from one daemon round trip: at the
request's first lookup it sends every key vLLM has registered for it (in
prefix order), and the daemon pins the leading hits in the same round trip
(`Scheduler.lookup_and_pin`), so a block another engine evicts between
lookup and load cannot be lost: vLLM's `prepare_load` then takes the pinned
slots without a round trip. The pins
go with `complete_load`, or with the request (`on_request_finished`). A key
vLLM loads that holds no pin (the pins went with a reset) is pinned then; if
that fails too, the load's spec names no segment (`UNSERVABLE`), and the
workers report its blocks for vLLM to recompute.

kvd never breaks vLLM: a daemon that is down, slow or refusing costs misses
and skipped stores, never an exception into the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

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

from kvd_client.errors import KvdError
from kvd_client.scheduler import Scheduler
from kvd_client.vllm.metrics import KvdCounters

log = logging.getLogger("kvd_client.vllm")
UNSERVABLE = -1  # the generation of a load spec whose slots kvd could not pin


class KvdLoadStoreSpec(CPULoadStoreSpec):
    """kvd slot ids, and the generation of the pool's segment they are slots of.

    A daemon restarted cold re-creates the pool; the workers keep the previous
    segment mapped, so a load pinned before the restart still reads the bytes
    it was promised, and a store meant for it never lands in the new one.
    """

    def __init__(self, slots: list[int], generation: int) -> None:
        super().__init__(slots)
        self.generation = generation


@dataclass
class _Request:
    """What one request's lookup found: its keys in prefix order and the pinned hits."""

    keys: list[bytes]
    hits: int | None  # None: a key is still being stored, look again next step
    # key -> (slot, generation of the pool's segment the slot is in)
    pinned: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    index: dict[bytes, int] = field(default_factory=dict)  # key -> its place in keys


class KvdOffloadingManager(OffloadingManager):
    def __init__(self, scheduler: Scheduler | None, *, enable_events: bool = False) -> None:
        self._scheduler = scheduler  # None: offloading off for this engine
        self._requests: dict[str, _Request] = {}
        self._counters = KvdCounters()
        # What this engine stored and evicted, for vLLM's KV events; the daemon
        # publishes the whole pool's (every engine's) on its own socket.
        self._events: list[OffloadingEvent] | None = [] if enable_events else None

    # -- lookups ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._scheduler is None:
            return LookupResult.MISS
        state = self._requests.get(req_context.req_id)
        registered = len(getattr(req_context, "_offload_key_positions", ()))
        if state is None or state.hits is None or registered != len(state.keys):
            state = self._look_up(req_context, state)  # once per request and step at most
        if state.hits is None:
            return LookupResult.RETRY
        return (
            LookupResult.HIT
            if state.index.get(key, state.hits) < state.hits
            else (LookupResult.MISS)
        )

    def _look_up(self, ctx: ReqContext, old: _Request | None) -> _Request:
        assert self._scheduler is not None
        if old is not None:
            self._unpin(old, list(old.pinned))
        positions: dict[bytes, int] = getattr(ctx, "_offload_key_positions", {})
        keys = [bytes(k) for k, _ in sorted(positions.items(), key=lambda kv: kv[1])]
        state = _Request(keys, 0, index={k: i for i, k in enumerate(keys)})
        self._requests[ctx.req_id] = state
        if not keys:
            return state
        self._counters.add("lookup_rpcs")
        self._counters.add("lookup_keys", len(keys))
        try:
            hits, spec = self._scheduler.lookup_and_pin(keys)  # one round trip
            state.hits = hits
            if hits:
                generation = self._generation()
                pins = zip(keys[:hits], spec.slots, strict=True)
                state.pinned = {key: (slot, generation) for key, slot in pins}
                self._counters.add("lookup_hit_keys", hits)
        except KvdError as exc:  # missing (evicted meanwhile), pin cap, daemon gone
            log.info("kvd lookup of request %s answered as a miss: %s", ctx.req_id, exc)
            self._counters.add("daemon_errors")
            state.hits = 0
            state.pinned = {}
        return state

    # -- loads -------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        wanted = [bytes(k) for k in keys]
        state = self._requests.get(req_context.req_id)
        if state is None:
            state = self._requests[req_context.req_id] = _Request([], 0)
        pins = [state.pinned.get(k) for k in wanted]
        generations = {pin[1] for pin in pins if pin is not None}
        if None in pins or len(generations) > 1:  # one spec names one segment
            self._unpin(state, [k for k in wanted if k in state.pinned])
            if not self._pin(state, wanted):
                self._counters.add("unservable_loads")
                return KvdLoadStoreSpec([0] * len(wanted), UNSERVABLE)
        slots = [state.pinned[k] for k in wanted]
        return KvdLoadStoreSpec([slot for slot, _ in slots], slots[0][1] if slots else UNSERVABLE)

    def _pin(self, state: _Request, keys: list[bytes]) -> bool:
        """Pins `keys`, which vLLM loads without a pin (a reset took it): true if
        they are now pinned, all in the pool's current segment."""
        if self._scheduler is None:
            return False
        try:
            spec = self._scheduler.prepare_load(keys)
        except KvdError as exc:
            log.info("kvd cannot serve a load vLLM asked for, recomputed: %s", exc)
            self._counters.add("daemon_errors")
            return False
        generation = self._generation()
        for key, slot in zip(keys, spec.slots, strict=True):
            state.pinned[key] = (slot, generation)
        return True

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        state = self._requests.get(req_context.req_id)
        if state is not None:
            self._unpin(state, [bytes(k) for k in keys if bytes(k) in state.pinned])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        if self._scheduler is not None:
            try:
                self._scheduler.touch([bytes(k) for k in keys])
            except KvdError as exc:
                log.debug("kvd touch skipped: %s", exc)

    def _generation(self) -> int:
        attached = self._scheduler.attached if self._scheduler is not None else None
        return attached.generation if attached is not None else 0

    def _unpin(self, state: _Request, keys: list[bytes]) -> None:
        if not keys or self._scheduler is None:
            return
        for key in keys:
            state.pinned.pop(key, None)
        try:
            self._scheduler.complete_load(keys)
        except KvdError as exc:  # a reconnect rolled the pins back already
            log.debug("kvd complete_load skipped: %s", exc)

    # -- stores ------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if self._scheduler is None:
            return None
        try:
            out = self._scheduler.prepare_store([bytes(k) for k in keys])
        except KvdError as exc:
            log.debug("kvd prepare_store skipped: %s", exc)
            self._counters.add("daemon_errors")
            self._counters.add("stores_skipped")
            return None
        if out is None:
            self._counters.add("stores_skipped")
            return None
        if out.evicted_keys and self._events is not None:
            self._events.append(OffloadingEvent(list(out.evicted_keys), Medium.CPU, removed=True))
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in out.keys_to_store],
            store_spec=KvdLoadStoreSpec(list(out.store_spec.slots), self._generation()),
            evicted_keys=[OffloadKey(k) for k in out.evicted_keys],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """vLLM calls this once every rank finished the store: kvd completes it then."""
        if self._scheduler is None:
            return
        stored = [bytes(k) for k in keys]
        try:
            self._scheduler.complete_store(stored, success)
        except KvdError as exc:  # the session changed under the store: it stays unready
            log.info("kvd complete_store refused: %s", exc)
            self._counters.add("daemon_errors")
            return
        if success:
            self._counters.add("stored_keys", len(stored))
            if self._events is not None and stored:
                self._events.append(
                    OffloadingEvent([OffloadKey(k) for k in stored], Medium.CPU, removed=False)
                )

    # -- requests and steps ------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = self._requests.pop(req_context.req_id, None)
        if state is not None:
            self._unpin(state, list(state.pinned))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._counters.take()

    def reset_cache(self) -> None:
        for state in self._requests.values():
            self._unpin(state, list(state.pinned))
        self._requests.clear()

    def shutdown(self) -> None:
        self.reset_cache()
        if self._scheduler is not None:
            self._scheduler.close()
