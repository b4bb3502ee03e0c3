"""Runs in the daemon: the daemon's counters and the `Stats` reply (SPEC section 8).

Handlers count into `Stats.counters` (a plain `Counter`, shared by the
control objects); requests are counted by type, so a request costs no
string work. `kvd stats`, the Prometheus collector and the tests read the
same `StatsResult`.
"""

from __future__ import annotations

import time
from collections import Counter

from kvd.control.pools import PoolRegistry
from kvd.version import __version__
from kvd_client import protocol as p


class Stats:
    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.requests: Counter[type] = Counter()
        self.started = time.monotonic()

    def result(
        self,
        req_id: int,
        *,
        sessions: int,
        jobs_in_flight: int,
        max_total_bytes: int,
        pools: PoolRegistry,
    ) -> p.StatsResult:
        return p.StatsResult(
            req_id,
            daemon_version=__version__,
            uptime_s=time.monotonic() - self.started,
            sessions=sessions,
            jobs_in_flight=jobs_in_flight,
            lease_expirations=self.counters["lease_expirations"],
            max_total_bytes=max_total_bytes,
            used_bytes=pools.used_bytes,
            pools=[pool.info() for pool in pools],
            counters={
                **self.counters,
                **{f"requests.{t.__name__}": n for t, n in self.requests.items()},
            },
        )
