"""The index events a slice per loop turn (`kvd.io.event_pump.EventPump`).

The pump is driven with stand-ins of its two ends: the service's outbox (a
list, as `PoolAdmin.event_outbox` is) and a publisher that records what it
is given, batch by batch (one batch per `flush`, as the real one sends).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

from kvd.io.event_pump import PUBLISH_KEYS_PER_TURN, EventPump
from kvd_client.types import OffloadingEvent


class Outbox:
    def __init__(self) -> None:
        self.event_outbox: list[tuple[str, list[OffloadingEvent] | None, tuple[Any, ...]]] = []
        self.counters: Counter[str] = Counter()

    def collect_events(self) -> None:
        """The events are in `event_outbox` already (the tests put them there)."""


class Recorder:
    batches_dropped = 0

    def __init__(self) -> None:
        self.pending: list[tuple[str, object]] = []
        self.batches: list[list[tuple[str, object]]] = []

    def add(self, pool: str, events: list[OffloadingEvent], groups: tuple[Any, ...] = ()) -> None:
        self.pending += [(pool, len(e.keys)) for e in events]

    def all_cleared(self, pool: str) -> None:
        self.pending.append((pool, "cleared"))

    def flush(self, now: float) -> None:
        if self.pending:
            self.batches.append(self.pending)
            self.pending = []


def event(n: int, first: int = 0) -> OffloadingEvent:
    return OffloadingEvent([i.to_bytes(8, "big") for i in range(first, first + n)], 16)


def pump() -> tuple[Outbox, Recorder, EventPump]:
    out, rec = Outbox(), Recorder()
    return out, rec, EventPump(cast(Any, out), cast(Any, rec))


def turns(p: EventPump, budget: int | None = PUBLISH_KEYS_PER_TURN) -> int:
    n = 1
    while p.send(budget):
        n += 1
    return n


def test_events_of_at_most_one_turn_are_never_cut() -> None:
    out, rec, p = pump()
    out.event_outbox.append(("a", [event(3000), event(3000)], ()))
    assert turns(p) == 1
    assert rec.batches == [[("a", 3000), ("a", 3000)]]


def test_a_long_event_goes_a_turn_of_keys_at_a_time_in_order() -> None:
    out, rec, p = pump()
    n = 2 * PUBLISH_KEYS_PER_TURN + 100
    big = event(n)
    out.event_outbox += [("a", [event(10), big], ()), ("b", None, ()), ("b", [event(5, 7)], ())]
    assert turns(p) == 3
    assert rec.batches == [
        [("a", 10), ("a", PUBLISH_KEYS_PER_TURN)],
        [("a", PUBLISH_KEYS_PER_TURN)],
        [("a", 100), ("b", "cleared"), ("b", 5)],
    ]
    assert out.event_outbox == []


def test_the_slices_are_the_event_s_keys_exactly_once() -> None:
    out, rec, p = pump()
    sent: list[bytes] = []
    rec.add = lambda pool, events, groups=(): sent.extend(  # type: ignore[method-assign]
        k for e in events for k in e.keys
    )
    big = event(3 * PUBLISH_KEYS_PER_TURN + 1)
    out.event_outbox.append(("a", [big], ()))
    assert turns(p) == 4
    assert sent == big.keys


def test_no_budget_sends_the_rest_of_a_cut_event_at_once() -> None:
    out, rec, p = pump()
    out.event_outbox.append(("a", [event(PUBLISH_KEYS_PER_TURN * 3)], ()))
    assert p.send(PUBLISH_KEYS_PER_TURN)  # one slice, more left
    assert not p.send(None)  # shutdown: all that is left
    assert rec.batches == [[("a", PUBLISH_KEYS_PER_TURN)], [("a", 2 * PUBLISH_KEYS_PER_TURN)]]
