"""Runs in the test process: `StoresInFlight`, the manager's stores matched to vLLM's completions.

Pure bookkeeping, no daemon: the settle path that completes orphans as
failed is run against a real daemon in `test_failure_rules_vllm.py`.
"""

from __future__ import annotations

import logging
import time

from kvd_client.vllm.boundary import FailureLog
from kvd_client.vllm.stores import StoresInFlight

A, B = b"a" * 8, b"b" * 8


def test_a_completion_takes_the_oldest_store_of_its_request_and_keys() -> None:
    stores = StoresInFlight(writers=2)
    first = stores.add("r1", [A, B], session=1, deadline=10.0)
    second = stores.add("r1", [B, A], session=2, deadline=20.0)  # the same keys again
    other = stores.add("r2", [A], session=2, deadline=20.0)
    assert len({first, second, other}) == 3 and min(first, second, other) > 0
    took = stores.take("r1", frozenset([A, B]))
    assert took is not None and (took.token, took.session, took.writers) == (first, 1, 2)
    took = stores.take("r1", frozenset([A, B]))
    assert took is not None and took.token == second
    assert stores.take("r1", frozenset([A, B])) is None  # none left: vLLM's extra call
    assert stores.take("r2", frozenset([B])) is None  # other keys: not this store
    assert stores.take("r2", frozenset([A])) is not None


def test_copy_reports_reach_a_store_by_token_in_flight_or_orphaned() -> None:
    stores = StoresInFlight(writers=2)
    token = stores.add("r", [A], session=1, deadline=time.monotonic() + 60)
    stores.on_copies({token: (1, True), 999: (1, True)})  # an unknown token: ignored
    stores.on_copies({token: (1, False)})
    assert stores.orphan_all(alive_handed=0.0) == 1
    orphan = stores.orphans[token]
    assert (orphan.reports, orphan.copied) == (2, False)
    assert stores.take("r", frozenset([A])) is None  # vLLM's completion is dropped


def test_a_reset_cancels_every_store_prepared_before_it() -> None:
    stores = StoresInFlight(writers=1)
    tokens = [stores.add("r", [bytes([i]) * 8], session=1, deadline=0.0) for i in range(3)]
    assert stores.cancel_below == 0
    stores.orphan_all(alive_handed=0.0)
    assert stores.cancel_below == max(tokens) + 1
    assert stores.add("r", [A], session=1, deadline=0.0) == stores.cancel_below  # copied


def test_settle_without_a_session_drops_the_orphans_at_once() -> None:
    """No session (offloading off and its session closed): no worker copies into
    slots the daemon took back with the session, and nothing could complete the
    stores, so every orphan goes, before its deadline too, and nothing is logged."""
    stores = StoresInFlight(writers=1)
    stores.add("r", [A], session=1, deadline=time.monotonic() + 60)
    stores.add("r", [B], session=1, deadline=0.0)
    assert stores.orphan_all(alive_handed=time.monotonic() + 60) == 2
    failures = FailureLog(logging.getLogger("test"))
    stores.settle(None, failures, flushed=False)
    assert stores.orphans == {} and failures._last == {}
