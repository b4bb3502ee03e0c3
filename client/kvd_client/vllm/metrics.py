"""Runs in vLLM's scheduler process: the plug-in's figures, as vLLM's offloading metrics.

vLLM's Prometheus exporter accepts only the names a spec declares
(`OffloadingSpec.build_metric_definitions`); the manager counts into a
`KvdCounters` and hands vLLM an `OffloadingConnectorStats` each interval
(`get_stats`). All are counters, unlabelled. The daemon's own metrics
(`kvd_*`, SPEC section 8) describe the pool as a whole; these describe what
one engine asked of it.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingMetricMetadata

PREFIX = "vllm:kv_offload_kvd_"
COUNTERS: dict[str, str] = {
    "lookup_rpcs": (
        "Daemon round trips made for lookups (one a request and KV cache group a step,"
        " and one a miss a sliding-window scan goes past, without the ready table)."
    ),
    "lookup_keys": "Keys vLLM looked up in kvd.",
    "lookup_hit_keys": "Keys kvd answered as hits (leading, ready, pinned for the load).",
    "daemon_errors": "kvd calls that failed (daemon down, slow, refusing): misses, skipped stores.",
    "stores_skipped": "Store requests kvd did not take (no room, pinned, daemon away or failing).",
    "stored_keys": "Keys whose store vLLM completed into kvd.",
    "stores_present": "Store requests kvd answered with nothing to store: every key in the "
    "pool already, ready or being stored (where the ready table shows them all ready, with "
    "no round trip).",
    "unservable_loads": "Loads kvd could no longer serve, handed to vLLM to recompute.",
    "stores_failed": "Stores completed as failed (a copy failed, refused past its deadline or "
    "cancelled): never ready.",
    "retries_given_up": "Requests kvd answered 'retry' (a key being stored or fetched) for "
    "longer than two leases: answered as misses, recomputed.",
    "stale_completions": "Store completions of an earlier session (a reconnect, a restart, a "
    "rolled-back lease): they completed nothing.",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {PREFIX + name: OffloadingCounterMetadata(documentation=doc)
            for name, doc in COUNTERS.items()}  # fmt: skip


class KvdCounters:
    """Counts since the last `take()`; names are the keys of `COUNTERS`."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, name: str, value: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"undeclared kvd metric {name!r}")
        if value:
            self._counts[name] = self._counts.get(name, 0) + value

    def take(self) -> OffloadingConnectorStats | None:
        if not self._counts:
            return None
        stats = OffloadingConnectorStats()
        for name, value in self._counts.items():
            stats.increase_counter(PREFIX + name, value)
        self._counts = {}
        return stats
