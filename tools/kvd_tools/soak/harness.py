"""Runs in the operator's shell (`kvd bench soak`) and in tests: a soak run with faults.

    harness ── starts ──> kvd daemon (child; SIGKILLed and started again once,
       │                  SIGSTOPped for 1 to 3 s now and then)
       │                  the fleet's clients (kvd_tools.soak.fleet)
       ├── FaultInjector: kills, stalls, reconnects, a pool's workers leaving
       ├── every check_every_s: CheckInvariants (not while the daemon is stopped)
       ├── after the SIGKILL: the restarted daemon adopts the pools warm
       │   (at least half the blocks ready just before it, else a violation)
       └── at the end: stop every client, wait for leases and jobs to run
           out, then 0 blocks pinned, 0 in flight, 0 jobs, invariants hold;
           count in the daemon's log the failure paths the faults reached

RSS is read from the restarted daemon: its warm-up ends at `warmup` (a
fraction of the run, after the restart at `restart_at`); `rss_start_mb` is
taken then and `rss_end_mb` when traffic stops, and the end may exceed the
start by at most max(`rss_slack_mb`, `rss_slack` x start).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvd_client.errors import KvdError
from kvd_tools.launcher import TEST_FLAGS, DaemonProcess
from kvd_tools.soak.evidence import daemon_evidence, went_away_cause
from kvd_tools.soak.faults import Fault, FaultInjector
from kvd_tools.soak.fleet import Fleet
from kvd_tools.soak.probes import daemon_stats, drained, invariant_problems, rss_mb
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.workload import WORLD_SIZE

# Faults a client fires, and the tally field that counts each time it did.
FIRED_BY_CLIENTS = {
    Fault.RECONNECT_WORKER: "worker_reconnects",
    Fault.LEAVE_SECOND_POOL: "second_pool_leaves",
    Fault.TIMEOUT_STORE: "store_timeouts",
}


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 60.0
    seed: int = 0
    num_actors: int = 4
    lease_ms: int = 2000
    job_timeout_ms: int = 3000
    events_buffer: int = 1000  # replay buffer: full well within the warm-up
    check_every_s: float = 2.0
    restart_at: float = 0.10  # fraction of the run: the daemon restart
    warmup: float = 0.35  # fraction of the run: the RSS baseline
    rss_slack_mb: float = 8.0
    rss_slack: float = 0.10


@dataclass
class SoakResult:
    seconds: float
    ops: int
    faults: int
    violations: int
    rss_start_mb: float
    rss_end_mb: float
    rss_limit_mb: float
    drain_s: float
    lease_expirations: int
    faults_by_kind: dict[str, int]
    totals: dict[str, int]
    evidence: dict[str, int] = field(default_factory=dict)  # kvd_tools.soak.evidence
    ready_before_restart: int = 0  # blocks ready in all pools just before the SIGKILL
    adopted_after_restart: int = 0  # blocks the restarted daemon adopted (its log)
    findings: list[str] = field(default_factory=list)
    run_dir: str = ""

    def row(self) -> dict[str, int | float]:
        """The `kvd bench soak` row: the SPEC section 10 fields first."""
        return {
            "seconds": round(self.seconds, 1),
            "ops": self.ops,
            "faults": self.faults,
            "violations": self.violations,
            "rss_start_mb": round(self.rss_start_mb, 1),
            "rss_end_mb": round(self.rss_end_mb, 1),
            "blocks_verified": self.totals["blocks_verified"],
            "drain_s": round(self.drain_s, 2),
            "hot_path_raises": self.totals["hot_path_raises"],
            "ready_before_restart": self.ready_before_restart,
            "adopted_after_restart": self.adopted_after_restart,
        }


def run_soak(config: SoakConfig) -> SoakResult:
    """Runs one soak; never leaves a process or a segment behind."""
    return Soak(config).run()


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvd-soak-"))
        ctx = mp.get_context("spawn")
        num_slots = Fleet.num_slots(cfg.num_actors)
        self.me = num_slots - 1
        self.tally = Tally(ctx, num_slots, self.run_dir, WORLD_SIZE)
        flags = {
            **TEST_FLAGS,
            "lease-ms": str(cfg.lease_ms),
            "job-timeout-ms": str(cfg.job_timeout_ms),
            "events-buffer": str(cfg.events_buffer),
            "log-level": "info",
            "max-total-bytes": "256MiB",
        }
        self.daemon = DaemonProcess(base=flags)
        wait_s = 2 * cfg.job_timeout_ms / 1000 + 2
        # After a stall or the restart, leases lapse and jobs time out for this long.
        excuse_s = 2 * cfg.lease_ms / 1000 + 2 * cfg.job_timeout_ms / 1000 + 2
        self.fleet = Fleet(ctx, self.tally, self.daemon, self.rng, cfg.num_actors, wait_s, excuse_s)

    def run(self) -> SoakResult:
        cfg = self.cfg
        injector = FaultInjector(
            self.rng, cfg.seconds, cfg.restart_at * cfg.seconds, log=self._log_fault
        )
        try:
            self.daemon.start()
            self.fleet.start_all()
            t0 = time.monotonic()
            next_check, rss_start = 0.0, 0.0
            while (elapsed := time.monotonic() - t0) < cfg.seconds:
                injector.tick(elapsed, self.fleet)
                for crash in self.fleet.crashed():
                    self._violation(crash)
                if elapsed >= next_check and not self.fleet.stalled:
                    self._check_invariants()
                    next_check = elapsed + cfg.check_every_s
                if not rss_start and elapsed >= cfg.warmup * cfg.seconds:
                    rss_start = self._rss()
                time.sleep(0.05)
            seconds = time.monotonic() - t0
            rss_end = self._rss()
            stopped = self.fleet.stop_clients()
            drain_s, expirations = self._drain(stopped)
            self._check_invariants()
            limit = rss_start + max(cfg.rss_slack_mb, cfg.rss_slack * rss_start)
            if rss_end > limit:
                self._violation(f"daemon RSS grew {rss_start:.1f} -> {rss_end:.1f} MiB")
            evidence = daemon_evidence(self.daemon.log_path)
            evidence["went_away_lease_expired"] = self._explain_went_away()
            self._check_warm(evidence)
            totals = self.tally.totals()
            by_kind = {str(k): n for k, n in injector.counts.items()}
            by_kind |= {str(k): totals[name] for k, name in FIRED_BY_CLIENTS.items()}
            return SoakResult(
                seconds=seconds,
                ops=totals["ops"],
                faults=sum(by_kind.values()),
                violations=totals["violations"],
                rss_start_mb=rss_start,
                rss_end_mb=rss_end,
                rss_limit_mb=limit,
                drain_s=drain_s,
                lease_expirations=expirations,
                faults_by_kind=dict(sorted(by_kind.items())),
                totals=totals,
                evidence=evidence,
                ready_before_restart=sum(self.fleet.ready_before_restart.values()),
                adopted_after_restart=sum(
                    n for k, n in evidence.items() if k.startswith("adopted.")
                ),
                findings=self.tally.findings(),
                run_dir=str(self.run_dir) if totals["violations"] else "",
            )
        finally:
            self._cleanup()

    def _check_invariants(self) -> None:
        try:
            problems = invariant_problems(self.daemon.endpoint)
        except KvdError as exc:
            self._violation(f"the daemon did not answer CheckInvariants: {exc}")
            return
        for problem in problems:
            self._violation(f"index invariant broken: {problem}")

    def _check_warm(self, evidence: dict[str, int]) -> None:
        """The cache outlived the daemon's SIGKILL (SPEC 13): each pool that held
        ready blocks just before it came back with at least half of them (traffic
        goes on between the count and the kill, so not all: a store in flight
        then evicted some, and is never adopted)."""
        for pool, before in self.fleet.ready_before_restart.items():
            adopted = evidence.get(f"adopted.{pool}", 0)
            if before > 0 and adopted < before // 2:
                self._violation(
                    f"pool {pool}: {before} blocks ready before the daemon's SIGKILL, "
                    f"{adopted} adopted after its restart: the cache did not stay warm"
                )
        if not self.fleet.ready_before_restart:
            self._violation("the daemon did not answer Stats just before its SIGKILL")

    def _explain_went_away(self) -> int:
        """Jobs the engine saw failed for a rank that "went away" though every rank acked:
        a violation unless that rank's lease had run out. Returns how many had."""
        lapsed = 0
        for job, detail in self.tally.went_away():
            cause, context = went_away_cause(self.daemon.log_path, job)
            if cause == "lease_expired":
                lapsed += 1
                continue
            self._violation(
                f"engine: daemon failed job {job}: {detail}, though every rank acknowledged "
                f"it ok, no stall or restart was near and no lease ran out (before it in the "
                f"daemon's log: {cause}): {' | '.join(context)}"
            )
        return lapsed

    def _drain(self, t0: float) -> tuple[float, int]:
        """Waits until no session, pin, in-flight block or job is left.

        Returns (seconds since `t0`, the daemon's lease expirations).
        """
        bound = 2 * self.daemon.lease_s + 2 * self.cfg.job_timeout_ms / 1000 + 10
        stats = None
        while True:
            with contextlib.suppress(KvdError):
                stats = daemon_stats(self.daemon.endpoint)
            if stats is not None and drained(stats):
                return time.monotonic() - t0, stats.lease_expirations
            if time.monotonic() - t0 > bound:
                break
            time.sleep(0.1)
        self._violation(f"not drained {bound:.0f} s after every client left: {stats!r}"[:1500])
        return time.monotonic() - t0, stats.lease_expirations if stats else -1

    def _rss(self) -> float:
        proc = self.daemon.proc
        return rss_mb(proc.pid) if proc is not None else 0.0

    def _log_fault(self, line: str) -> None:
        """The fault sequence, kept with the findings (`faults.log` in the run dir)."""
        with open(self.run_dir / "faults.log", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    def _violation(self, detail: str) -> None:
        self.tally.violation(self.me, f"harness: {detail}")

    def _cleanup(self) -> None:
        self.fleet.kill_all()
        if self.tally.total("violations") and not os.environ.get("KVD_KEEP_LOGS"):
            # Keep the daemon's log with the findings.
            with contextlib.suppress(OSError):
                shutil.copy(self.daemon.log_path, self.run_dir / "daemon.log")
        self.daemon.stop()
        if not os.environ.get("KVD_KEEP_LOGS") and not self.tally.total("violations"):
            shutil.rmtree(self.run_dir, ignore_errors=True)
