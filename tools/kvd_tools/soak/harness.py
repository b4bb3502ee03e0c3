"""Runs in the operator's shell (`kvd bench soak`) and in tests: a soak run with faults.

    harness ── starts ──> kvd daemon (child; SIGKILLed and started again once)
       │                  4 scheduler actors (kvd_tools.soak.actors)
       │                  1 TP=2 engine: scheduler + 2 ranks (kvd_tools.soak.engine, .rank)
       ├── FaultInjector: SIGKILLs actors, the engine, its ranks; restarts
       ├── every check_every_s: CheckInvariants, daemon RSS (VmRSS)
       └── at the end: stop every client, wait for leases and jobs to run
           out, then 0 blocks pinned, 0 in flight, 0 jobs, invariants hold

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
import signal
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvd_client.errors import KvdError
from kvd_tools.launcher import TEST_FLAGS, DaemonProcess
from kvd_tools.soak.actors import actor_main
from kvd_tools.soak.engine import engine_main
from kvd_tools.soak.faults import FaultInjector
from kvd_tools.soak.probes import (
    daemon_stats,
    drained,
    invariant_problems,
    is_spawned_child,
    parent_of,
    rss_mb,
)
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.workload import WORLD_SIZE


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
        }


def run_soak(config: SoakConfig) -> SoakResult:
    """Runs one soak; never leaves a process or a segment behind."""
    return Soak(config).run()


class Soak:
    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.num_actors = cfg.num_actors
        self.world_size = WORLD_SIZE
        self.rng = random.Random(cfg.seed)
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvd-soak-"))
        self.ctx = mp.get_context("spawn")
        self.engine_slot = cfg.num_actors
        self.me = cfg.num_actors + 1 + WORLD_SIZE
        self.tally = Tally(self.ctx, self.me + 1, self.run_dir, WORLD_SIZE)
        flags = {
            **TEST_FLAGS,
            "lease-ms": str(cfg.lease_ms),
            "job-timeout-ms": str(cfg.job_timeout_ms),
            "events-buffer": str(cfg.events_buffer),
            "log-level": "info",
            "max-total-bytes": "256MiB",
        }
        self.daemon = DaemonProcess(base=flags)
        self.actors: list[BaseProcess | None] = [None] * cfg.num_actors
        self.engine: BaseProcess | None = None
        self.killed: set[int] = set()  # pids this harness SIGKILLed on purpose
        self.wait_s = 2 * cfg.job_timeout_ms / 1000 + 2

    # -- Targets (for the fault injector) --------------------------------------

    def start_actor(self, index: int) -> None:
        args = (self.tally, index, self.daemon.endpoint, self.rng.randrange(1 << 32))
        proc = self.ctx.Process(target=actor_main, args=args, name=f"actor{index}")
        proc.start()
        self.actors[index] = proc

    def start_engine(self) -> None:
        args = (self.tally, self.engine_slot, self.daemon.endpoint, self.rng.randrange(1 << 32))
        self.engine = self.ctx.Process(target=engine_main, args=(*args, self.wait_s), name="engine")
        self.engine.start()

    def _kill(self, proc: BaseProcess | None) -> bool:
        if proc is None or not proc.is_alive() or proc.pid is None:
            return False
        self.killed.add(proc.pid)
        proc.kill()
        proc.join(timeout=10)
        return True

    def kill_actor(self, index: int) -> bool:
        if not self._kill(self.actors[index]):
            return False
        self.actors[index] = None
        return True

    def kill_engine(self) -> bool:
        if not self._kill(self.engine):
            return False
        self.engine = None  # its ranks see their engine gone and exit
        return True

    def kill_worker(self, rank: int) -> bool:
        pid = self.tally.worker_pid(rank)
        engine = self.engine
        if engine is None or pid <= 0 or parent_of(pid) != engine.pid:
            return False
        os.kill(pid, signal.SIGKILL)
        return True

    def restart_daemon(self) -> None:
        self.daemon.kill(signal.SIGKILL)
        self.daemon.start()

    # -- the run ---------------------------------------------------------------

    def run(self) -> SoakResult:
        cfg = self.cfg
        injector = FaultInjector(self.rng, cfg.seconds, cfg.restart_at * cfg.seconds)
        try:
            self.daemon.start()
            for i in range(cfg.num_actors):
                self.start_actor(i)
            self.start_engine()
            t0 = time.monotonic()
            next_check, rss_start = 0.0, 0.0
            while (elapsed := time.monotonic() - t0) < cfg.seconds:
                injector.tick(elapsed, self)
                self._watch_children()
                if elapsed >= next_check:
                    self._check_invariants()
                    next_check = elapsed + cfg.check_every_s
                if not rss_start and elapsed >= cfg.warmup * cfg.seconds:
                    rss_start = self._rss()
                time.sleep(0.05)
            seconds = time.monotonic() - t0
            rss_end = self._rss()
            stopped = self._stop_clients()
            drain_s, expirations = self._drain(stopped)
            self._check_invariants()
            limit = rss_start + max(cfg.rss_slack_mb, cfg.rss_slack * rss_start)
            if rss_end > limit:
                self._violation(f"daemon RSS grew {rss_start:.1f} -> {rss_end:.1f} MiB")
            totals = self.tally.totals()
            return SoakResult(
                seconds=seconds,
                ops=totals["ops"],
                faults=injector.total,
                violations=totals["violations"],
                rss_start_mb=rss_start,
                rss_end_mb=rss_end,
                rss_limit_mb=limit,
                drain_s=drain_s,
                lease_expirations=expirations,
                faults_by_kind={str(k): n for k, n in injector.counts.items()},
                totals=totals,
                findings=self.tally.findings(),
                run_dir=str(self.run_dir) if totals["violations"] else "",
            )
        finally:
            self._cleanup()

    def _watch_children(self) -> None:
        """A client that exits on its own (not by our SIGKILL) crashed: count it, start it again."""
        for i, proc in enumerate(self.actors):
            if proc is not None and not proc.is_alive() and proc.pid not in self.killed:
                self._violation(f"actor {i} exited by itself with code {proc.exitcode}")
                self.start_actor(i)
        engine = self.engine
        if engine is not None and not engine.is_alive() and engine.pid not in self.killed:
            self._violation(f"the engine exited by itself with code {engine.exitcode}")
            self.start_engine()

    def _check_invariants(self) -> None:
        try:
            problems = invariant_problems(self.daemon.endpoint)
        except KvdError as exc:
            self._violation(f"the daemon did not answer CheckInvariants: {exc}")
            return
        for problem in problems:
            self._violation(f"index invariant broken: {problem}")

    def _stop_clients(self) -> float:
        """Stops every client: about half gracefully (Goodbye), the rest by SIGKILL.

        Returns when the last client was killed (time.monotonic()).
        """
        self.tally.stop()
        procs = [*self.actors, self.engine]
        for proc in procs:
            if self.rng.random() < 0.5:
                self._kill(proc)
        stopped = time.monotonic()
        for proc in procs:
            if proc is not None:
                proc.join(timeout=30)
                if self._kill(proc):
                    stopped = time.monotonic()
        self._kill_orphans()
        return stopped

    def _kill_orphans(self) -> None:
        """Ranks whose engine was SIGKILLed exit by themselves; make sure of it."""
        for rank in range(WORLD_SIZE):
            pid = self.tally.worker_pid(rank)
            deadline = time.monotonic() + 5
            while pid > 0 and parent_of(pid) != -1 and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid > 0 and parent_of(pid) != -1 and is_spawned_child(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

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

    def _violation(self, detail: str) -> None:
        self.tally.violation(self.me, f"harness: {detail}")

    def _cleanup(self) -> None:
        self.tally.stop()
        for proc in [*self.actors, self.engine]:
            self._kill(proc)
        self._kill_orphans()
        self.daemon.stop()
        if not os.environ.get("KVD_KEEP_LOGS") and not self.tally.total("violations"):
            shutil.rmtree(self.run_dir, ignore_errors=True)
