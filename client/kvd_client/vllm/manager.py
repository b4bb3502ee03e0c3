"""Runs in vLLM's scheduler process: vLLM's `OffloadingManager` over kvd's index verbs.

vLLM asks `lookup(key)` once per key of every waiting request, every step.
The manager answers a request's keys from one daemon round trip: at the
request's first lookup it sends every key vLLM has registered for it (in
prefix order), and pins the leading hits at once (`prepare_load`), so a block
another engine evicts between lookup and load cannot be lost: vLLM's
`prepare_load` then takes the pinned slots without a round trip. The pins
go with `complete_load`, or with the request (`on_request_finished`).

kvd never breaks vLLM: a daemon that is down, slow or refusing costs misses
and skipped stores, never an exception into the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
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

log = logging.getLogger("kvd_client.vllm")


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
    pinned: dict[bytes, int] = field(default_factory=dict)  # key -> slot
    index: dict[bytes, int] = field(default_factory=dict)  # key -> its place in keys
    generation: int = 0  # of the pool's segment the pinned slots belong to


class KvdOffloadingManager(OffloadingManager):
    def __init__(self, scheduler: Scheduler | None) -> None:
        self._scheduler = scheduler  # None: offloading off for this engine
        self._requests: dict[str, _Request] = {}

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
        try:
            hits = self._scheduler.lookup(keys)
            state.hits = hits
            if hits:
                spec = self._scheduler.prepare_load(keys[:hits])
                state.pinned = dict(zip(keys[:hits], spec.slots, strict=True))
                state.generation = self._generation()
        except KvdError as exc:  # missing (evicted meanwhile), pin cap, daemon gone
            log.info("kvd lookup of request %s answered as a miss: %s", ctx.req_id, exc)
            state.hits = 0
            state.pinned = {}
        return state

    # -- loads -------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        state = self._requests.get(req_context.req_id)
        slots = []
        for key in keys:
            if state is None or bytes(key) not in state.pinned:
                # vLLM loads only what lookup answered HIT, which is pinned.
                raise KvdError(f"vLLM loads key {bytes(key).hex()} that kvd did not pin")
            slots.append(state.pinned[bytes(key)])
        return KvdLoadStoreSpec(slots, state.generation if state is not None else 0)

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
            return None
        if out is None:
            return None
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
        try:
            self._scheduler.complete_store([bytes(k) for k in keys], success)
        except KvdError as exc:  # the session changed under the store: it stays unready
            log.info("kvd complete_store refused: %s", exc)

    # -- requests and steps ------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = self._requests.pop(req_context.req_id, None)
        if state is not None:
            self._unpin(state, list(state.pinned))

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()  # the daemon publishes the pool's events itself (SPEC section 8)

    def reset_cache(self) -> None:
        for state in self._requests.values():
            self._unpin(state, list(state.pinned))
        self._requests.clear()

    def shutdown(self) -> None:
        self.reset_cache()
        if self._scheduler is not None:
            self._scheduler.close()
