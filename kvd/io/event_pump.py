"""Runs in the daemon: the index events of each loop turn to the event publisher, a slice at a time.

Each turn sends events until `PUBLISH_KEYS_PER_TURN` keys went (the last
one whole: an event of at most that many keys is never cut). A longer one,
such as a warm restart's announcement of a million blocks, goes out that
many keys a turn, requests served in between, each slice cut from the event
where the last one stopped (no copy of the whole event is made up front:
at 1M keys that alone held the loop a fifth of a second). What is left
waits, in order, for the next turn.
"""

from __future__ import annotations

import time
from dataclasses import replace

from kvd.control.service import Service
from kvd.io.events import EventPublisher
from kvd_client.types import OffloadingEvent

# Keys of index events encoded per loop turn (a few milliseconds): a warm
# pool's announcement of its blocks must not hold the requests back.
PUBLISH_KEYS_PER_TURN = 4096


class EventPump:
    def __init__(self, service: Service, publisher: EventPublisher) -> None:
        self._service = service
        self._publisher = publisher
        self._cut = 0  # keys of the outbox's first event sent already

    def send(self, budget: int | None) -> bool:
        """Sends at most `budget` keys of the pending events (None: all); True
        while some are left for the next turn."""
        service, publisher = self._service, self._publisher
        service.collect_events()
        outbox = service.event_outbox
        if not outbox:
            return False
        left = budget
        while outbox and (left is None or left > 0):
            pool, events, groups = outbox[0]
            if events is None:
                publisher.all_cleared(pool)
                del outbox[0]
                continue
            taken: list[OffloadingEvent] = []
            while events and (left is None or left > 0):
                # An event of at most one turn's keys goes whole; a longer one a
                # turn's keys at a time (`_cut` of them went already).
                event, cut, n = events[0], self._cut, len(events[0].keys)
                end = n if left is None else min(n, cut + PUBLISH_KEYS_PER_TURN)
                whole = cut == 0 and end == n
                taken.append(event if whole else replace(event, keys=event.keys[cut:end]))
                if left is not None:
                    left -= end - cut
                if end == n:
                    events.pop(0)
                    self._cut = 0
                else:
                    self._cut = end
            publisher.add(pool, taken, groups)
            if not events:
                del outbox[0]
        publisher.flush(time.time())
        service.counters["events_replay_dropped"] = publisher.batches_dropped
        return bool(outbox)
