"""Runs in the test process: the Prometheus exposition of the daemon's counters."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvd.io.metrics import Metrics
from kvd_client import protocol as p

LAYOUT = p.Layout("m", "bfloat16", 16, 1, False, 4096)


def pool(name: str, ready: int, in_flight: int, pinned: int, free: int) -> p.PoolInfo:
    n = ready + in_flight + free
    return p.PoolInfo(
        name,
        f"/kvd.{name}.1",
        1,
        LAYOUT,
        "lru",
        n,
        4096,
        n * 4096,
        ready,
        in_flight,
        pinned,
        free,
        2,
    )


def stats(counters: dict[str, int], pools: list[p.PoolInfo] | None = None) -> p.StatsResult:
    return p.StatsResult(
        0,
        daemon_version="0.1.0",
        uptime_s=12.5,
        sessions=3,
        jobs_in_flight=4,
        lease_expirations=5,
        max_total_bytes=1 << 30,
        used_bytes=1 << 20,
        pools=pools if pools is not None else [pool("a", 3, 1, 2, 6), pool("b", 0, 0, 0, 8)],
        counters=counters,
    )


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            assert isinstance(s, Sample)
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: Metrics, name: str, **labels: str) -> float:
    return samples(m)[(name, frozenset(labels.items()))]


COUNTERS = {
    "lookups": 7,
    "lookup_keys": 70,
    "hit_blocks": 40,
    "stores": 3,
    "stores_rejected": 1,
    "loads": 2,
    "blocks_stored": 30,
    "evictions": 9,
    "bytes_stored": 1 << 20,
    "bytes_loaded": 1 << 19,
    "errors.BAD_REQUEST": 2,
    "errors.SOMETHING_NEW": 1,
    "requests.Lookup": 7,
    "requests.Hello": 1,
    "jobs_failed.store": 1,
    "lease_expirations": 5,
}


def test_counters_and_gauges_after_update() -> None:
    m = Metrics()
    m.update(stats(COUNTERS))
    expected = {
        "kvd_lookups_total": 7,
        "kvd_lookup_keys_total": 70,
        "kvd_hit_blocks_total": 40,
        "kvd_stores_total": 3,
        "kvd_stores_rejected_total": 1,
        "kvd_loads_total": 2,
        "kvd_blocks_stored_total": 30,
        "kvd_evictions_total": 9,
        "kvd_lease_expirations_total": 5,
        "kvd_sessions": 3,
        "kvd_jobs_in_flight": 4,
        "kvd_pools": 2,
        "kvd_used_bytes": 1 << 20,
        "kvd_max_total_bytes": 1 << 30,
        "kvd_uptime_seconds": 12.5,
    }
    for name, v in expected.items():
        assert value(m, name) == v, name
    assert value(m, "kvd_transfer_bytes_total", direction="store") == 1 << 20
    assert value(m, "kvd_transfer_bytes_total", direction="load") == 1 << 19
    assert value(m, "kvd_errors_total", code="BAD_REQUEST") == 2
    assert value(m, "kvd_errors_total", code="SOMETHING_NEW") == 1
    assert value(m, "kvd_errors_total", code="PIN_LIMIT") == 0  # known codes start at 0
    assert value(m, "kvd_requests_total", type="Lookup") == 7
    assert value(m, "kvd_jobs_failed_total", kind="store") == 1
    assert value(m, "kvd_jobs_failed_total", kind="load") == 0
    assert value(m, "kvd_build_info", version="0.1.0") == 1


def test_blocks_by_pool_and_state_and_capacity() -> None:
    m = Metrics()
    m.update(stats({}))
    assert [
        value(m, "kvd_pool_blocks", pool="a", state=s)
        for s in ("ready", "in_flight", "pinned", "free")
    ] == [3, 1, 2, 6]
    assert value(m, "kvd_pool_blocks", pool="b", state="free") == 8
    assert value(m, "kvd_pool_capacity_bytes", pool="a") == 10 * 4096
    assert value(m, "kvd_pool_capacity_blocks", pool="b") == 8
    assert value(m, "kvd_pool_sessions", pool="a") == 2
    assert value(m, "kvd_lookups_total") == 0  # missing counters read 0, the series exist


def test_the_latest_snapshot_wins_and_dropped_pools_vanish() -> None:
    m = Metrics()
    m.update(stats({"lookups": 1}))
    m.update(stats({"lookups": 2}, pools=[pool("b", 1, 0, 0, 7)]))
    s = samples(m)
    assert s[("kvd_lookups_total", frozenset())] == 2
    assert not any(labels and ("pool", "a") in labels for _, labels in s)
    assert s[("kvd_pool_blocks", frozenset({("pool", "b"), ("state", "ready")}))] == 1


def test_before_the_first_update_only_static_series() -> None:
    names = {name for name, _ in samples(Metrics())}
    assert names == {"kvd_build_info"}


def test_rpc_histogram_buckets_count_and_sum() -> None:
    m = Metrics()
    for seconds in (5e-6, 1e-5, 3e-5, 2e-3, 7.0):
        m.observe_rpc("Lookup", seconds)
    m.observe_rpc("Hello", 1e-4)

    def bucket(le: str, rtype: str = "Lookup") -> float:
        return value(m, "kvd_rpc_duration_seconds_bucket", type=rtype, le=le)

    assert bucket("1e-05") == 2  # le is inclusive
    assert bucket("2.5e-05") == 2
    assert bucket("5e-05") == 3
    assert bucket("0.0025") == 4
    assert bucket("1.0") == 4
    assert bucket("+Inf") == 5
    assert value(m, "kvd_rpc_duration_seconds_count", type="Lookup") == 5
    assert value(m, "kvd_rpc_duration_seconds_sum", type="Lookup") == pytest.approx(7.002045)
    assert bucket("0.0001", "Hello") == 1
    assert bucket("5e-05", "Hello") == 0


def test_rpc_type_label_is_bounded() -> None:
    m = Metrics()
    for i in range(200):
        m.observe_rpc(f"T{i}", 1e-4)
    types = {
        dict(labels)["type"]
        for name, labels in samples(m)
        if name == "kvd_rpc_duration_seconds_count"
    }
    assert len(types) == 65
    assert value(m, "kvd_rpc_duration_seconds_count", type="other") == 136


def test_registries_are_private() -> None:
    a, b = Metrics(), Metrics()
    a.observe_rpc("Lookup", 1e-4)
    assert b"Lookup" not in b.render()


@pytest.mark.parametrize("addr", ["9464", "localhost", "host:", ":9464", "h:99999", "h:port"])
def test_bad_metrics_address(addr: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        Metrics().start_http(addr)


def test_remote_tier_series_only_with_a_remote_tier() -> None:
    m = Metrics()
    m.update(stats(COUNTERS))
    assert not any(name.startswith("kvd_remote") for name, _ in samples(m))
    remote = {
        "remote.connected": 1,
        "remote.probes": 9,
        "remote.hits": 40,
        "remote.misses": 2,
        "remote.bad_values": 3,
        "remote.blocks_written": 50,
        "remote.writes_skipped": 4,
        "remote.errors": 1,
        "remote.bytes_read": 1 << 22,
        "remote.bytes_written": 1 << 23,
        "remote.write_bytes_in_flight": 4096,
    }
    m.update(stats({**COUNTERS, **remote}))
    assert value(m, "kvd_remote_connected") == 1
    assert value(m, "kvd_remote_hits_total") == 40
    assert value(m, "kvd_remote_misses_total") == 2
    assert value(m, "kvd_remote_bad_values_total") == 3
    assert value(m, "kvd_remote_blocks_written_total") == 50
    assert value(m, "kvd_remote_writes_skipped_total") == 4
    assert value(m, "kvd_remote_errors_total") == 1
    assert value(m, "kvd_remote_timeouts_total") == 0  # known series start at 0
    assert value(m, "kvd_remote_bytes_total", direction="read") == 1 << 22
    assert value(m, "kvd_remote_bytes_total", direction="written") == 1 << 23
    assert value(m, "kvd_remote_write_bytes_in_flight") == 4096


def test_the_disk_tier_series_appear_once_it_is_configured() -> None:
    m = Metrics()
    m.update(stats(COUNTERS))
    assert not any(name.startswith("kvd_disk_") for name, _ in samples(m))
    disk = {"disk.capacity_bytes": 1 << 30, "disk.hits": 12, "disk.bad_rows": 1,
            "disk.bytes_read": 4096, "disk.bytes_written": 8192, "disk.blocks": 5,
            "disk.bytes_used": 5 << 12, "disk.writes_skipped": 3}  # fmt: skip
    m.update(stats({**COUNTERS, **disk}))
    assert value(m, "kvd_disk_hits_total") == 12
    assert value(m, "kvd_disk_bad_rows_total") == 1
    assert value(m, "kvd_disk_writes_skipped_total") == 3
    assert value(m, "kvd_disk_timeouts_total") == 0  # known counters start at 0
    assert value(m, "kvd_disk_bytes_total", direction="read") == 4096
    assert value(m, "kvd_disk_bytes_total", direction="written") == 8192
    assert value(m, "kvd_disk_capacity_bytes") == 1 << 30
    assert value(m, "kvd_disk_used_bytes") == 5 << 12
    assert value(m, "kvd_disk_blocks") == 5
