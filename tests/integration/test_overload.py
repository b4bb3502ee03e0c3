"""Runs in the test process: 16 client processes at full speed, and the daemon keeps answering.

Sixteen spawned scheduler processes run lookups, stores and loads back to back
for KVD_OVERLOAD_SECONDS (default 12), timing every call. Meanwhile an idle
`Scheduler` in this process sends nothing but its keeper thread's heartbeats,
on a daemon whose lease is 1 s, holding pins on four blocks. Afterwards: no
call timed out (a client that waits past its timeout reconnects and its old
session expires), no lease expired, the idle session is still the same one,
its pinned blocks survived the churn and it releases them, and the index
invariants hold. Prints p50 / p99 / p99.9 / max latency and ops/s.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from multiprocessing.synchronize import Barrier
from queue import Empty
from typing import Any

from kvd_client import Layout, Scheduler
from kvd_client.errors import MissingKey, NotReady
from kvd_tools.launcher import DaemonProcess

CLIENTS = 16
SECONDS = float(os.environ.get("KVD_OVERLOAD_SECONDS", "12"))
LEASE_MS = 1000
LAYOUT = ("overload-model", "bfloat16", 16, 1, False, 4096)
CAPACITY = 16 << 20  # 4096 blocks
NUM_KEYS = 8192


def client_main(endpoint: str, index: int, seconds: float, barrier: Barrier, out: Any) -> None:
    """One client process: random verbs as fast as the daemon answers them."""
    rng = random.Random(index)
    s = Scheduler(
        "overload",
        Layout(*LAYOUT),
        engine_id=f"load-{index}",
        endpoint=endpoint,
        capacity_bytes=CAPACITY,
    )
    samples: list[int] = []
    timeouts = 0

    def timed(call: Any, *args: Any) -> Any:
        nonlocal timeouts
        t0 = time.perf_counter_ns()
        result = call(*args)
        samples.append(time.perf_counter_ns() - t0)
        if not s.connected:  # the call timed out: the library dropped the session
            timeouts += 1
        return result

    barrier.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        first = rng.randrange(NUM_KEYS)
        keys = [(first + i).to_bytes(8, "big") for i in range(rng.randint(1, 32))]
        r = rng.random()
        if r < 0.7:
            timed(s.lookup, keys)
        elif r < 0.85:
            out_ = timed(s.prepare_store, keys[:8])
            if out_ is not None:
                timed(s.complete_store, out_.keys_to_store)
        else:
            hits = timed(s.lookup, keys)
            if hits:
                try:
                    timed(s.prepare_load, keys[:hits])
                except (MissingKey, NotReady):
                    continue  # evicted or re-stored by another client since the lookup
                timed(s.complete_load, keys[:hits])
    s.close()
    out.put((index, samples, timeouts))


def percentile(sorted_ns: list[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(len(sorted_ns) * q))] / 1000


def test_sixteen_clients_at_full_speed() -> None:
    ctx = mp.get_context("spawn")
    daemon = DaemonProcess(lease_ms=str(LEASE_MS), log_level="warning").start()
    procs = []
    idle = None
    try:
        idle = Scheduler(
            "overload",
            Layout(*LAYOUT),
            engine_id="idle",
            endpoint=daemon.endpoint,
            capacity_bytes=CAPACITY,
        )
        mine = [b"idle-%d" % i for i in range(4)]
        out = idle.prepare_store(mine)
        assert out is not None
        idle.complete_store(mine)
        idle.prepare_load(mine)  # pinned for as long as this session lives
        session = idle.session_id

        barrier = ctx.Barrier(CLIENTS + 1)
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=client_main, args=(daemon.endpoint, i, SECONDS, barrier, queue))
            for i in range(CLIENTS)
        ]
        for proc in procs:
            proc.start()
        barrier.wait(timeout=120)
        t0 = time.monotonic()
        results: list[tuple[int, list[int], int]] = []
        while len(results) < CLIENTS:
            try:
                results.append(queue.get(timeout=1))
            except Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"clients died with {dead}"
                assert time.monotonic() - t0 < SECONDS + 120, "clients did not finish"
        wall = time.monotonic() - t0
        for proc in procs:
            proc.join(timeout=30)
            assert proc.exitcode == 0

        samples = sorted(ns for _, ss, _ in results for ns in ss)
        timeouts = sum(t for _, _, t in results)
        p50, p99 = percentile(samples, 0.50), percentile(samples, 0.99)
        p999, worst = percentile(samples, 0.999), samples[-1] / 1000
        print(
            f"\noverload: {CLIENTS} clients, {len(samples)} requests in {wall:.1f} s "
            f"({len(samples) / wall:.0f}/s); latency p50 {p50:.0f} us, p99 {p99:.0f} us, "
            f"p99.9 {p999:.0f} us, max {worst:.0f} us; lease {LEASE_MS} ms"
        )
        stats = idle.stats()
        assert timeouts == 0, f"{timeouts} calls timed out"
        assert stats.lease_expirations == 0, "a live session was expired"
        assert idle.connected and idle.session_id == session
        # The pool churned through every unpinned block; the pins held.
        assert stats.counters.get("evictions", 0) > 0
        assert idle.lookup(mine) == len(mine)
        idle.complete_load(mine)  # NOT_OWNER if the session had been rolled back
        assert idle.check_invariants() == []
        assert p99 < LEASE_MS * 1000 / 4, f"p99 {p99:.0f} us"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
        if idle is not None:
            idle.close()
        daemon.stop()
