"""Runs in the operator's shell: `kvd bench soak --seconds N`, the daemon under faults.

One row (SPEC section 10): `seconds`, `ops`, `faults`, `violations`,
`rss_start_mb`, `rss_end_mb`, then `blocks_verified` (engine loads checked
byte for byte), `drain_s` (from the last client gone to 0 pins, 0 blocks in
flight, 0 jobs) and `hot_path_raises` (client calls that raised where SPEC
section 7 promises 0 hits or None); then `faults_by_kind`, and `reached`:
how often the clients and the daemon's log saw each fault's path (jobs
rebound to a reconnected session, jobs refused unstarted, leaves during a
job, store timeouts, lease expirations). See `kvd_tools.soak` for what runs.

`--vllm` runs the soak on real vLLM instead (`kvd_tools.vllm_harness.soak`):
two engines on one small pool, every answer checked against vLLM without a
connector; its row has the same first fields (`ops` = requests), then
`max_request_s`, `request_bound_s`, `loaded_blocks`, `vllm_loaded_bytes`, `engine_restarts`,
`drained` and `faults_by_kind`.

This module imports nothing heavy at import time: the registry may import
`add_arguments` from here.
"""

from __future__ import annotations

import argparse
from typing import Any

MIN_SECONDS = 10  # the daemon restart, the warm-up and a few faults must fit
# The daemon's SIGKILL and warm restart comes at a tenth of the run, but no
# sooner than this: the fleet's clients (spawned processes) must have made
# their pools and stored blocks, or there is no cache to keep warm (and the
# soak counts a violation). The RSS warm-up then ends this much later.
RESTART_AFTER_S = 4.0
WARMUP_AFTER_RESTART_S = 2.5


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value < MIN_SECONDS:
        raise argparse.ArgumentTypeError(
            f"a soak needs at least {MIN_SECONDS} seconds, got {text!r}"
        )
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seconds",
        type=_seconds,
        default=60.0,
        metavar="S",
        help="how long traffic and faults run, at least 10 (default: 60; a soak: 600)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="two real vLLM engines on one small pool under faults, every answer checked "
        "against vLLM without a connector (kvd_tools.vllm_harness.soak)",
    )


def passed(rows: list[dict[str, Any]]) -> bool:
    """The soak's verdict: no violation (`kvd bench soak` exits 1 otherwise)."""
    return all(row["violations"] == 0 for row in rows)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd_tools.bench.suites import SuiteError
    from kvd_tools.soak import SoakConfig, run_soak

    if args.seconds < MIN_SECONDS:
        raise SuiteError(f"a soak needs at least {MIN_SECONDS} seconds, got {args.seconds:g}")
    if getattr(args, "vllm", False):
        from kvd_tools.vllm_harness.soak import VllmSoakConfig, run_vllm_soak

        return [run_vllm_soak(VllmSoakConfig(seconds=args.seconds, seed=args.seed)).row()]
    defaults = SoakConfig()
    restart_at = max(defaults.restart_at, RESTART_AFTER_S / args.seconds)
    warmup = max(defaults.warmup, restart_at + WARMUP_AFTER_RESTART_S / args.seconds)
    config = SoakConfig(seconds=args.seconds, seed=args.seed, restart_at=restart_at, warmup=warmup)
    result = run_soak(config)
    row: dict[str, Any] = dict(result.row())
    row["rss_limit_mb"] = round(result.rss_limit_mb, 1)
    row["lease_expirations"] = result.lease_expirations
    row["faults_by_kind"] = ",".join(f"{k}={n}" for k, n in sorted(result.faults_by_kind.items()))
    t, ev = result.totals, result.evidence
    reached = {
        "jobs_rebound": ev.get("jobs_rebound", 0),
        "reconnects_before_read": t["reconnects_before_read"],
        "leaves_during_job": t["leaves_during_job"],
        "late_refusals": t["late_refusals"],
        "engine_store_timeouts": t["engine_store_timeouts"],
        "late_store_answers": t["late_store_answers"],
        "acked_but_failed": t["acked_but_failed"],
        "session_held": ev.get("session_held", 0),
        "worker_replaced": ev.get("worker_replaced", 0),
    }
    failed = {k: n for k, n in ev.items() if k.startswith("failed_")}
    row["reached"] = ",".join(f"{k}={n}" for k, n in {**reached, **failed}.items())
    if result.findings:
        row["findings"] = " | ".join(result.findings[:3])
    return [row]


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    row = rows[0]
    if "request_bound_s" in row:  # --vllm
        verdict = "PASS" if row["violations"] == 0 else "FAIL"
        lines = [
            f"{row['requests']} requests on two vLLM engines, {row['faults']} faults "
            f"({row['faults_by_kind']}), {row['violations']} violations ({verdict}).",
            f"Longest batch {row['max_request_s']} s (bound {row['request_bound_s']} s: "
            f"{row['slowest']}); "
            f"{row['loaded_blocks']} blocks loaded from kvd ({row['vllm_loaded_bytes']} bytes by "
            f"vLLM's count), {row['engine_restarts']} engine "
            f"restarts; remote tier {'on' if row['remote_tier'] else 'off'}; drained at the "
            f"end: {row['drained']}.",
        ]
        if row.get("findings"):
            lines.append(f"First findings: {row['findings']}")
        return lines
    grew = row["rss_end_mb"] - row["rss_start_mb"]
    lines = [
        f"{row['ops']} operations, {row['faults']} faults ({row['faults_by_kind']}), "
        f"{row['violations']} violations ({'PASS' if row['violations'] == 0 else 'FAIL'}).",
        f"Daemon RSS after warm-up {row['rss_start_mb']} MiB, at the end {row['rss_end_mb']} MiB "
        f"({grew:+.1f} MiB; limit {row['rss_limit_mb']} MiB).",
        f"Drained (0 pinned, 0 in flight, 0 jobs) {row['drain_s']} s after the last client left.",
        f"{row['blocks_verified']} loaded blocks verified byte for byte; "
        f"{row['lease_expirations']} lease expirations.",
        f"Fault paths reached: {row['reached']}.",
    ]
    if row.get("findings"):
        lines.append(f"First findings: {row['findings']}")
    return lines
