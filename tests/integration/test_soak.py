"""Runs in the test process: the soak with faults, reduced to KVD_SOAK_SECONDS (default 60).

Four scheduler actors, one TP=2 engine, the engine's twin on a second pool
and a short-timeout scheduler of the engine run random traffic on the
daemon while actors, the engine, its ranks and the twin are SIGKILLed and
restarted, the daemon is SIGKILLed and started again once (adopting its pools warm) and SIGSTOPped
for 1 to 3 s now and then, a rank reconnects during a store and the twin's
workers leave while an engine job runs. No load may return other bytes than
were stored, the index invariants must hold throughout, the daemon's RSS
must not grow after warm-up, and once every client is gone nothing may stay
pinned or in flight. Each new fault must reach its path in the daemon (its
log says so). The full run is `kvd bench soak --seconds 600`.
"""

from __future__ import annotations

import os

import pytest

from kvd_tools.soak import SoakConfig, run_soak
from kvd_tools.soak.faults import NEW_KINDS, Fault

SECONDS = float(os.environ.get("KVD_SOAK_SECONDS", "60"))


@pytest.mark.slow
def test_soak_with_faults() -> None:
    config = SoakConfig(seconds=SECONDS, seed=int(os.environ.get("KVD_SOAK_SEED", "0")))
    result = run_soak(config)
    print(
        f"\nsoak: {result.row()} faults={result.faults_by_kind} totals={result.totals} "
        f"evidence={result.evidence}"
    )
    findings = "\n".join(result.findings)
    assert result.violations == 0, (
        f"{result.violations} violations (logs: {result.run_dir}):\n{findings}"
    )
    by_kind, totals = result.faults_by_kind, result.totals
    assert by_kind.get("restart_daemon") == 1
    # The daemon's SIGKILL and restart kept the cache warm (SPEC 13).
    assert result.ready_before_restart > 0
    assert result.adopted_after_restart >= result.ready_before_restart // 2
    assert result.faults >= 1 + int(SECONDS // 10), by_kind
    # Each new kind came, and reached the path it is for.
    assert all(by_kind.get(kind, 0) >= 1 for kind in (*NEW_KINDS, Fault.TIMEOUT_STORE)), by_kind
    assert result.evidence["jobs_rebound"] >= 1  # a reconnect's session took over its job
    assert totals["leaves_during_job"] >= 1  # the other pool's workers left mid-job
    assert totals["late_refusals"] >= 1  # a timed-out store's job was never started
    assert result.ops >= 100 * SECONDS
    assert totals["blocks_verified"] >= SECONDS  # the engine did load and check
    assert totals["stores"] > 0
    assert result.rss_start_mb > 0 and result.rss_end_mb <= result.rss_limit_mb
    # Leases and hard job deadlines run out, then nothing is left.
    assert result.drain_s <= (2 * config.lease_ms + 2 * config.job_timeout_ms) / 1000 + 10
