"""The table lookups a `Scheduler` reports (`Observe`), drained by two threads at once.

`LookupReports.flush` runs on the reporter thread and on the engine's thread
(`Scheduler.flush_observed`: any call first reports what waits), so the queue it drains is shared: with a
tiny switch interval the two interleave at every bytecode, and no lookup
may be lost, sent twice, or raise into the engine (issue 24, finding 7).
No daemon: the connection is a stand-in that records what was posted.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import kvd_client.scheduler as scheduler_module
from kvd_client import Layout, Scheduler, observe
from kvd_client import protocol as p


class FakeConnection:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.connected = True
        self.on_disconnect: Any = None
        self.posted: list[tuple[list[list[bytes]], list[int]]] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    def post(self, cls: Any, lookups: list[list[bytes]], hits: list[int]) -> bool:
        assert cls is p.Observe
        with self._lock:
            self.posted.append((lookups, hits))
        return True

    def close(self) -> None:
        pass


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def test_two_threads_draining_the_observed_lookups_lose_none_and_raise_nothing(
    monkeypatch: pytest.MonkeyPatch, tiny_switch_interval: None
) -> None:
    monkeypatch.setattr(scheduler_module, "Connection", FakeConnection)
    s = Scheduler("p", Layout("m", "bfloat16", 16, 1, False, 256), engine_id="e", use_table=False)
    conn = s._conn
    assert isinstance(conn, FakeConnection)
    errors: list[BaseException] = []
    per_thread = 20_000

    def engine(base: int) -> None:
        try:
            for i in range(per_thread):
                s._observed.add([(base + i).to_bytes(8, "big")], i % 2)
                if i % 3 == 0:
                    s.flush_observed()  # what `_call` does before a round trip
        except BaseException as exc:  # the test reports any
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(n * per_thread,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.close()  # stops the reporter thread, flushes the rest
    assert errors == []
    sent = [k for lookups, _ in conn.posted for k in lookups]
    assert sorted(sent) == [[i.to_bytes(8, "big")] for i in range(3 * per_thread)]


def test_the_reporter_reports_a_lone_lookup_soon_then_sleeps_until_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In an engine's process a thread that wakes every few ms takes the GIL from
    the engine's step: with nothing queued the reporter must not run at all."""
    monkeypatch.setattr(scheduler_module, "Connection", FakeConnection)
    s = Scheduler("p", Layout("m", "bfloat16", 16, 1, False, 256), engine_id="e", use_table=False)
    conn = s._conn
    assert isinstance(conn, FakeConnection)
    flushes = 0
    real_flush = s._observed.flush

    def counted() -> int:
        nonlocal flushes
        flushes += 1
        return real_flush()

    monkeypatch.setattr(s._observed, "flush", counted)  # what the reporter thread calls
    try:
        for n in range(2):
            s._observed.add([n.to_bytes(8, "big")], 1)
            deadline = time.monotonic() + 2.0
            while len(conn.posted) <= n and time.monotonic() < deadline:
                time.sleep(0.001)
            assert len(conn.posted) == n + 1  # reported without another lookup
            before = flushes
            time.sleep(20 * observe.OBSERVE_EVERY_S)
            assert flushes == before  # idle: the thread did not wake
    finally:
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 1.0  # the sleeping reporter stops at once
    assert s._observed.thread is not None and not s._observed.thread.is_alive()
