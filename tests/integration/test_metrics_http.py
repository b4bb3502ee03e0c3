"""Runs in the test process: /metrics served over HTTP from the metrics thread."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest

from kvd.io.metrics import Metrics
from kvd_client import protocol as p


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return str(r.read().decode())


def test_http_endpoint_serves_the_latest_snapshot() -> None:
    with Metrics() as m:
        port = m.start_http("127.0.0.1:0")
        assert port > 0
        m.update(p.StatsResult(0, "0.1.0", 1.0, 2, 0, 0, 1 << 30, 0, [], {"lookups": 11}))
        m.observe_rpc("Lookup", 2e-5)
        text = scrape(port)
        assert "kvd_lookups_total 11.0" in text
        assert "kvd_sessions 2.0" in text
        assert 'kvd_rpc_duration_seconds_count{type="Lookup"} 1.0' in text
        with pytest.raises(RuntimeError):
            m.start_http("127.0.0.1:0")
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    m.close()  # idempotent


def test_scrapes_while_the_loop_thread_writes() -> None:
    """A scrape never sees a torn histogram row: count equals the +Inf bucket."""
    with Metrics() as m:
        port = m.start_http("127.0.0.1:0")
        stop = threading.Event()

        def writer() -> None:
            i = 0
            while not stop.is_set():
                m.observe_rpc(f"T{i % 80}", 1e-5 * (i % 50))
                i += 1

        t = threading.Thread(target=writer)
        t.start()
        try:
            for _ in range(20):
                text = scrape(port)
                for line in text.splitlines():
                    if line.startswith("kvd_rpc_duration_seconds_count"):
                        labels, count = line.rsplit(" ", 1)
                        rtype = labels.split('type="')[1].split('"')[0]
                        inf = f'kvd_rpc_duration_seconds_bucket{{le="+Inf",type="{rtype}"}} {count}'
                        assert inf in text
        finally:
            stop.set()
            t.join()
