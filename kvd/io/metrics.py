"""Runs in the daemon: Prometheus metrics, served over HTTP from a thread (SPEC section 8).

Two writers feed one collector on the loop thread; the HTTP thread reads it:

- `update(stats)` swaps in the latest `StatsResult` (one reference
  assignment), so a scrape reads one consistent snapshot of the counters;
- `observe_rpc` counts request latencies into plain lists: the loop thread is
  the only writer, and a scrape copies each row in one step under the GIL.
  Cheaper than `prometheus_client.Histogram`, whose observe takes a lock.

The registry is this object's own, never the process-global one.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvd.version import __version__
from kvd_client.errors import ErrorCode
from kvd_client.protocol import StatsResult
from kvd_client.types import JOB_KINDS

# 10 us to 1 s: a lookup answers in tens of microseconds, a stuck loop in seconds.
RPC_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
)
# repr() spells these small floats as Prometheus does ("1e-05", "0.0001", "1.0").
_LE = [repr(b) for b in RPC_BUCKETS] + ["+Inf"]
# Request types are class names, a closed set; the cap guards the label
# against a caller that passes something unbounded.
_MAX_RPC_TYPES = 64
_OTHER = "other"

# (metric, help, key in StatsResult.counters), all daemon-wide.
_COUNTERS = (
    ("kvd_lookups", "Lookup requests.", "lookups"),
    ("kvd_lookup_keys", "Keys asked for by lookups.", "lookup_keys"),
    ("kvd_hit_blocks", "Leading blocks found ready by lookups.", "hit_blocks"),
    (
        "kvd_observed_lookups",
        "Lookups schedulers answered from a ready table and reported.",
        "observed_lookups",
    ),
    ("kvd_stores", "Store transfer jobs started.", "stores"),
    ("kvd_stores_rejected", "Store requests refused because nothing fit.", "stores_rejected"),
    ("kvd_loads", "Load transfer jobs started.", "loads"),
    ("kvd_blocks_stored", "Blocks that became ready.", "blocks_stored"),
    ("kvd_evictions", "Blocks evicted to make room.", "evictions"),
)
_STATES = ("ready", "in_flight", "pinned", "free", "held")
# The remote tier (SPEC 14), exported once it is configured (`remote.connected`
# is then always in the counters): (metric, help, key).
_REMOTE_COUNTERS = (
    ("kvd_remote_probes", "Lookups that asked the remote tier for the keys after a miss.",
     "remote.probes"),
    ("kvd_remote_hits", "Blocks fetched from the remote tier, checked, and made ready.",
     "remote.hits"),
    ("kvd_remote_misses", "Probes that found no leading block in the remote tier.",
     "remote.misses"),
    ("kvd_remote_bad_values", "Remote values refused (format, key, length or checksum).",
     "remote.bad_values"),
    ("kvd_remote_fetch_failures", "Blocks given slots for a fetch that did not arrive whole.",
     "remote.fetch_failures"),
    ("kvd_remote_timeouts", "Fetches given up for making no progress within the timeout.",
     "remote.timeouts"),
    ("kvd_remote_blocks_written", "Blocks written to the remote tier.", "remote.blocks_written"),
    ("kvd_remote_writes_skipped",
     "Blocks not written: past the bytes-in-flight bound, pin cap, tier down, or evicted.",
     "remote.writes_skipped"),
    ("kvd_remote_errors", "Remote calls that failed (connection, timeout, server error).",
     "remote.errors"),
)  # fmt: skip


# The disk tier (SPEC 16), exported once it is configured (`disk.capacity_bytes`
# is then always in the counters): (metric, help, key).
_DISK_COUNTERS = (
    ("kvd_disk_hits", "Blocks read from the disk tier, verified, and made ready.", "disk.hits"),
    ("kvd_disk_misses", "Lookups past RAM whose next block the disk tier did not hold.",
     "disk.misses"),
    ("kvd_disk_fetches", "Reads from the disk tier started by lookups.", "disk.fetches"),
    ("kvd_disk_bad_rows", "Rows read back short or failing their checksum: misses.",
     "disk.bad_rows"),
    ("kvd_disk_rows_dropped", "Damaged rows dropped from the disk index.", "disk.rows_dropped"),
    ("kvd_disk_fetch_failures", "Blocks given slots for a disk read that did not end ready.",
     "disk.fetch_failures"),
    ("kvd_disk_timeouts", "Disk reads given up past disk_timeout_ms.", "disk.timeouts"),
    ("kvd_disk_blocks_written", "Blocks written to the disk tier.", "disk.blocks_written"),
    ("kvd_disk_writes_skipped",
     "Blocks not written: past the bytes-in-flight bound, pin cap, reset, or evicted.",
     "disk.writes_skipped"),
    ("kvd_disk_writes_deferred", "Blocks stored once, written at their second store "
     "(disk_admit = second).", "disk.writes_deferred"),
    ("kvd_disk_writes_failed", "Blocks whose write failed.", "disk.writes_failed"),
    ("kvd_disk_errors", "Row reads and writes that failed (EIO, ...).", "disk.errors"),
    ("kvd_disk_no_room", "Disk reads not started: no RAM room for them.", "disk.no_room"),
    ("kvd_disk_reads_refused", "Disk reads not started: 2 GiB already being read.",
     "disk.reads_refused"),
    ("kvd_disk_stalled_skips", "Lookups that skipped the disk: a read of the key still stuck.",
     "disk.stalled_skips"),
    ("kvd_disk_write_timeouts", "Writes that let go of their RAM rows after 4 disk timeouts.",
     "disk.write_timeouts"),
)  # fmt: skip
_DISK_GAUGES = (
    ("kvd_disk_used_bytes", "Bytes of rows the disk tier holds.", "disk.bytes_used"),
    ("kvd_disk_capacity_bytes", "Bytes of rows the slabs can hold.", "disk.capacity_bytes"),
    ("kvd_disk_blocks", "Blocks the disk tier holds.", "disk.blocks"),
    ("kvd_disk_write_bytes_in_flight", "Bytes the disk write-behind holds pinned now.",
     "disk.write_bytes_in_flight"),
    ("kvd_disk_read_bytes_in_flight", "Bytes of disk reads under way.",
     "disk.read_bytes_in_flight"),
    ("kvd_disk_slabs_failed", "Pools left without a disk tier: their slab could not be made.",
     "disk.slabs_failed"),
)  # fmt: skip


class Metrics(Collector):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._stats: StatsResult | None = None
        # Per request type: non-cumulative bucket counts, then the sum of seconds.
        self._rows: dict[str, list[float]] = {}
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.registry.register(self)

    # -- writers (loop thread) ---------------------------------------------------

    def observe_rpc(self, request_type: str, seconds: float) -> None:
        row = self._rows.get(request_type)
        if row is None:
            row = self._new_row(request_type)
        row[bisect_left(RPC_BUCKETS, seconds)] += 1
        row[-1] += seconds

    def _new_row(self, request_type: str) -> list[float]:
        if len(self._rows) >= _MAX_RPC_TYPES:
            request_type = _OTHER
        row = self._rows.get(request_type)
        if row is None:
            row = [0.0] * (len(RPC_BUCKETS) + 2)
            self._rows[request_type] = row
        return row

    def update(self, stats: StatsResult) -> None:
        """Publishes a snapshot for the next scrape; the caller must not mutate it after."""
        self._stats = stats

    # -- reader (HTTP thread) ----------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvd_build_info", "kvd version.", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        yield self._rpc_histogram()
        stats = self._stats
        if stats is not None:
            yield from self._from_stats(stats)

    def _rpc_histogram(self) -> HistogramMetricFamily:
        h = HistogramMetricFamily(
            "kvd_rpc_duration_seconds",
            "Time to handle one control request, by request type.",
            labels=["type"],
        )
        for rtype, shared in list(self._rows.items()):
            row = list(shared)  # one copy: buckets and sum from the same instant
            cumulative, buckets = 0.0, []
            for le, n in zip(_LE, row[:-1], strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            h.add_metric([rtype], buckets, row[-1])
        return h

    def _from_stats(self, s: StatsResult) -> Iterator[Metric]:
        c = s.counters
        for name, text, key in _COUNTERS:
            yield CounterMetricFamily(name, text, value=c.get(key, 0))
        moved = CounterMetricFamily(
            "kvd_transfer_bytes",
            "Bytes copied by acknowledged transfer jobs, by direction.",
            labels=["direction"],
        )
        moved.add_metric(["store"], c.get("bytes_stored", 0))
        moved.add_metric(["load"], c.get("bytes_loaded", 0))
        yield moved
        yield self._by_prefix(
            c, "requests.", "kvd_requests", "Control requests, by type.", "type", ()
        )
        yield self._by_prefix(
            c, "errors.", "kvd_errors", "Error replies, by code.", "code", tuple(ErrorCode)
        )
        yield self._by_prefix(
            c,
            "jobs_failed.",
            "kvd_jobs_failed",
            "Failed transfer jobs, by kind.",
            "kind",
            JOB_KINDS,
        )
        if "remote.connected" in c:
            yield from self._remote(c)
        if "disk.capacity_bytes" in c:
            yield from self._disk(c)
        yield CounterMetricFamily(
            "kvd_lease_expirations", "Sessions rolled back at lease expiry.", s.lease_expirations
        )
        yield GaugeMetricFamily("kvd_sessions", "Open sessions, all roles.", s.sessions)
        yield GaugeMetricFamily(
            "kvd_jobs_in_flight", "Transfer jobs not yet settled.", s.jobs_in_flight
        )
        yield GaugeMetricFamily("kvd_pools", "Pools.", len(s.pools))
        yield GaugeMetricFamily("kvd_used_bytes", "Bytes of all pools together.", s.used_bytes)
        yield GaugeMetricFamily(
            "kvd_max_total_bytes", "Upper bound on all pools together.", s.max_total_bytes
        )
        yield GaugeMetricFamily(
            "kvd_uptime_seconds", "Seconds since the daemon started.", s.uptime_s
        )
        blocks = GaugeMetricFamily(
            "kvd_pool_blocks",
            "Blocks by pool and state (pinned blocks are also ready).",
            labels=["pool", "state"],
        )
        capacity = GaugeMetricFamily(
            "kvd_pool_capacity_bytes", "Bytes of the pool's segment.", labels=["pool"]
        )
        num_blocks = GaugeMetricFamily(
            "kvd_pool_capacity_blocks", "Blocks the pool holds.", labels=["pool"]
        )
        sessions = GaugeMetricFamily(
            "kvd_pool_sessions", "Sessions attached to the pool.", labels=["pool"]
        )
        for p in s.pools:
            counts = (p.blocks_ready, p.blocks_in_flight, p.blocks_pinned, p.blocks_free,
                      p.blocks_held)  # fmt: skip
            for state, n in zip(_STATES, counts, strict=True):
                blocks.add_metric([p.name, state], n)
            capacity.add_metric([p.name], p.capacity_bytes)
            num_blocks.add_metric([p.name], p.num_blocks)
            sessions.add_metric([p.name], p.sessions)
        yield from (blocks, capacity, num_blocks, sessions)

    @staticmethod
    def _remote(c: dict[str, int]) -> Iterator[Metric]:
        for name, text, key in _REMOTE_COUNTERS:
            yield CounterMetricFamily(name, text, value=c.get(key, 0))
        moved = CounterMetricFamily(
            "kvd_remote_bytes", "Bytes of values moved to and from the remote tier.",
            labels=["direction"],
        )  # fmt: skip
        moved.add_metric(["read"], c.get("remote.bytes_read", 0))
        moved.add_metric(["written"], c.get("remote.bytes_written", 0))
        yield moved
        yield GaugeMetricFamily(
            "kvd_remote_connected", "1 while the remote tier answers, else 0.",
            c.get("remote.connected", 0),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kvd_remote_write_bytes_in_flight", "Bytes the write-behind holds pinned now.",
            c.get("remote.write_bytes_in_flight", 0),
        )  # fmt: skip

    @staticmethod
    def _disk(c: dict[str, int]) -> Iterator[Metric]:
        for name, text, key in _DISK_COUNTERS:
            yield CounterMetricFamily(name, text, value=c.get(key, 0))
        for name, text, key in _DISK_GAUGES:
            yield GaugeMetricFamily(name, text, c.get(key, 0))
        moved = CounterMetricFamily(
            "kvd_disk_bytes", "Bytes of rows moved to and from the disk tier.",
            labels=["direction"],
        )  # fmt: skip
        moved.add_metric(["read"], c.get("disk.bytes_read", 0))
        moved.add_metric(["written"], c.get("disk.bytes_written", 0))
        yield moved

    @staticmethod
    def _by_prefix(
        counters: dict[str, int],
        prefix: str,
        name: str,
        text: str,
        label: str,
        known: tuple[str, ...],
    ) -> CounterMetricFamily:
        # Known label values start at 0, so rate() sees the first increment.
        values = dict.fromkeys(known, 0)
        for key, n in counters.items():
            if key.startswith(prefix):
                values[key[len(prefix) :]] = n
        family = CounterMetricFamily(name, text, labels=[label])
        for value, n in sorted(values.items()):
            family.add_metric([value], n)
        return family

    # -- HTTP ----------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition, as a scrape would get it."""
        return generate_latest(self.registry)

    def start_http(self, addr: str) -> int:
        """Serves /metrics on "host:port" ("[::1]:9464" for IPv6; port 0 picks a
        free one) from a daemon thread; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("the metrics server is already running")
        host, sep, port_text = addr.rpartition(":")
        if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
            raise ValueError(f"metrics address {addr!r} is not host:port")
        server, thread = start_http_server(int(port_text), host.strip("[]"), registry=self.registry)
        self._server, self._thread = server, thread
        return int(server.server_port)

    def close(self) -> None:
        """Stops the HTTP server, if started; idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
