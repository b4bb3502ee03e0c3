"""Runs in vLLM's scheduler process: the manager's stores in flight and their completions.

vLLM completes a store by its request and keys alone, so each `prepare_store`
that hands out slots is kept here (`Store`: its keys, the session it was
prepared in, its deadline, a token the workers echo) until vLLM completes it:
`take` matches a completion to the oldest store of that request and those
keys. The workers' copy reports reach a store by its token (`on_copies`).

A cache reset (`orphan_all`) drops vLLM's completions of the stores in flight:
they become orphans, no store with an older token may be copied any more
(`cancel_below`), and `settle` fails each one as soon as no worker can copy
it (every writer reported, or past its deadline and the latest deadline the
workers were told, with a copy's margin), so no lookup waits on it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

from kvd_client.scheduler import Scheduler
from kvd_client.vllm.boundary import FailureLog
from kvd_client.vllm.records import Store

COPY_MARGIN_S = 1.0  # a copy started before its deadline has ended by this much after


class StoresInFlight:
    def __init__(self, writers: int) -> None:
        self.writers = writers  # workers that copy each store
        # By (request, keys), the oldest first, and by token.
        self._by_keys: dict[tuple[str, frozenset[bytes]], deque[Store]] = {}
        self._by_token: dict[int, Store] = {}
        self._next_token = 1
        self.orphans: dict[int, Store] = {}  # by token: completions vLLM dropped
        self.cancel_below = 0  # no store with a lower token may be copied
        self._alive_at_reset = 0.0  # the latest `alive_until` the workers had then

    def add(self, req_id: str, keys: list[bytes], session: int, deadline: float) -> int:
        """A store prepared in `session` for `req_id`: its token."""
        token, self._next_token = self._next_token, self._next_token + 1
        store = Store(token, keys, session, deadline, self.writers)
        self._by_keys.setdefault((req_id, frozenset(keys)), deque()).append(store)
        self._by_token[token] = store
        return token

    def take(self, req_id: str, keys: frozenset[bytes]) -> Store | None:
        """The store vLLM completes (the oldest of `req_id` and `keys`), no longer in
        flight; None if none is (vLLM dropped it, or it stored nothing)."""
        found = self._by_keys.get((req_id, keys))
        if not found:
            return None
        store = found.popleft()
        if not found:
            del self._by_keys[req_id, keys]
        del self._by_token[store.token]
        return store

    def on_copies(self, copies: Mapping[int, tuple[int, bool]]) -> None:
        """The workers' reports, `token -> (workers, all copied)`."""
        for token, (workers, copied) in copies.items():
            store = self._by_token.get(token) or self.orphans.get(token)
            if store is not None:
                store.reports += workers
                store.copied = store.copied and copied

    def orphan_all(self, alive_handed: float) -> int:
        """A cache reset: every store in flight is orphaned, none prepared so far may
        be copied from now on; `alive_handed` is the latest `alive_until` the workers
        were told. How many are orphans now."""
        for queue in self._by_keys.values():
            for store in queue:
                self.orphans[store.token] = store
        self._by_keys.clear()
        self._by_token.clear()
        self.cancel_below = self._next_token
        self._alive_at_reset = alive_handed
        return len(self.orphans)

    def settle(self, scheduler: Scheduler | None, failures: FailureLog, flushed: bool) -> None:
        """Fails the orphans no worker can copy any more (module docstring; all of
        them once vLLM says the workers `flushed` the reset's jobs) in `scheduler`'s
        session; those of an earlier session went with it."""
        connected = scheduler is not None and scheduler.connected
        current = scheduler.epoch if scheduler is not None and connected else None
        now = time.monotonic()
        for token, store in list(self.orphans.items()):
            copying = store.session == current and store.reports < store.writers
            if (
                copying
                and not flushed
                and now < max(store.deadline, self._alive_at_reset) + COPY_MARGIN_S
            ):
                continue  # a worker may still copy it
            del self.orphans[token]
            if store.session != current or scheduler is None:
                continue  # it went with its session
            try:
                scheduler.complete_store(store.keys, False)
            except Exception as exc:  # the boundary
                failures.note("complete_store", exc, "left to the daemon's rollback")
