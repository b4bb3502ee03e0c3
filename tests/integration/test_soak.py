"""Runs in the test process: the soak with faults, reduced to KVD_SOAK_SECONDS (default 60).

Four scheduler actors and one TP=2 engine run random traffic on one pool while
actors, the engine and its ranks are SIGKILLed and restarted and the daemon is
SIGKILLed and started again once. No load may return other bytes than were
stored, the index invariants must hold throughout, the daemon's RSS must not
grow after warm-up, and once every client is gone nothing may stay pinned or
in flight. The full run is `kvd bench soak --seconds 600`.
"""

from __future__ import annotations

import os

import pytest

from kvd_tools.soak import SoakConfig, run_soak

SECONDS = float(os.environ.get("KVD_SOAK_SECONDS", "60"))


@pytest.mark.slow
def test_soak_with_faults() -> None:
    config = SoakConfig(seconds=SECONDS, seed=int(os.environ.get("KVD_SOAK_SEED", "0")))
    result = run_soak(config)
    print(f"\nsoak: {result.row()} faults={result.faults_by_kind} totals={result.totals}")
    findings = "\n".join(result.findings)
    assert result.violations == 0, (
        f"{result.violations} violations (logs: {result.run_dir}):\n{findings}"
    )
    assert result.faults_by_kind.get("restart_daemon") == 1
    assert result.faults >= 1 + int(SECONDS // 10), result.faults_by_kind
    assert result.ops >= 100 * SECONDS
    assert result.totals["blocks_verified"] >= SECONDS  # the engine did load and check
    assert result.totals["stores"] > 0
    assert result.rss_start_mb > 0 and result.rss_end_mb <= result.rss_limit_mb
    # Leases and hard job deadlines run out, then nothing is left.
    assert result.drain_s <= (2 * config.lease_ms + 2 * config.job_timeout_ms) / 1000 + 10
