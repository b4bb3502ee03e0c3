"""Runs in the operator's shell and in tests: two vLLM engines on one small kvd pool under faults.

`kvd bench soak --vllm --seconds N` prints its row (`tests/vllm/test_soak_vllm.py`
runs a short one):


    reference engine (no connector)  every prompt's greedy tokens and top logprobs, once
    daemon (+ redis-server)          one pool of `pool_blocks` blocks, a remote tier
    engine 0, engine 1 (threads)     batches of 1 to 3 prompts sharing prefixes; every
                                     third batch after vLLM's own cache reset, so that
                                     kvd serves the prefixes; each answer checked
    the main thread                  a fault every `period_s` (`vllm_faults`)

A violation is an answer that is not the reference's (`differences`: a
token, or a top logprob further than `LOGPROB_TOLERANCE`), an engine that
died or raised, or a request that took longer than `request_bound_s`. An
engine that broke is started again so that the run goes on. At the end,
with the engines gone, the daemon must hold nothing pinned or in flight
within two leases and two job timeouts, and its invariants must hold.

Prompts longer than 65,536 offload keys do not fit this model (4,096
tokens, 128 keys); the longest prompt it allows is one of the faults.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvd_client.errors import KvdError
from kvd_tools.launcher import TEST_FLAGS, DaemonProcess
from kvd_tools.redis_launcher import RedisServer
from kvd_tools.redis_launcher import available as redis_available
from kvd_tools.soak.probes import daemon_stats, drained, invariant_problems, rss_mb
from kvd_tools.vllm_harness.driver import EngineProcess, Output
from kvd_tools.vllm_harness.engine import BLOCK_SIZE, write_model
from kvd_tools.vllm_harness.soak_engine import MAX_TOKENS, EngineSlot
from kvd_tools.vllm_harness.vllm_faults import Fault, FaultPlan

POOL = "soak-vllm"
PAGE_BYTES = 2 * 2 * 2 * 64 * BLOCK_SIZE * 2  # the tiny Llama's block (tests/vllm)
MAX_MODEL_LEN = 4096
PREFIX_TOKENS, SUFFIX_TOKENS, FLOOD_TOKENS = 256, 96, 1024
LONG_TOKENS = MAX_MODEL_LEN - MAX_TOKENS - BLOCK_SIZE  # the longest prompt vLLM takes here


@dataclass(frozen=True)
class VllmSoakConfig:
    seconds: float = 600.0
    seed: int = 0
    lease_ms: int = 2000
    job_timeout_ms: int = 3000
    pool_blocks: int = 96  # a flood of the other engine evicts most of it
    gpu_blocks: int = 160  # vLLM's own cache: one longest prompt and a little more
    families: int = 6
    suffixes: int = 4
    period_s: tuple[float, float] = (4.0, 8.0)
    request_bound_s: float = 60.0
    remote: bool = True  # a remote tier (and its stalls) where redis-server is installed


@dataclass
class VllmSoakResult:
    seconds: float
    requests: int
    faults_by_kind: dict[str, int]
    violations: list[str]
    max_request_s: float
    slowest: str
    request_bound_s: float
    loaded_blocks: int  # the daemon's count: blocks pinned for a load
    hit_blocks: int
    vllm_loaded_bytes: int  # vLLM's own count of bytes its connector loaded
    engine_restarts: int
    remote: bool
    drained: bool
    rss_start_mb: float  # the daemon's, once both engines run (a later daemon's after a kill)
    rss_end_mb: float
    run_dir: str = ""

    def row(self) -> dict[str, Any]:
        """The `kvd bench soak --vllm` row: the SPEC section 10 soak fields first."""
        return {
            "seconds": round(self.seconds, 1),
            "ops": self.requests,
            "faults": sum(self.faults_by_kind.values()),
            "violations": len(self.violations),
            "rss_start_mb": round(self.rss_start_mb, 1),
            "rss_end_mb": round(self.rss_end_mb, 1),
            "requests": self.requests,
            "max_request_s": round(self.max_request_s, 2),
            "slowest": self.slowest,
            "request_bound_s": self.request_bound_s,
            "loaded_blocks": self.loaded_blocks,
            "hit_blocks": self.hit_blocks,
            "vllm_loaded_bytes": self.vllm_loaded_bytes,
            "engine_restarts": self.engine_restarts,
            "remote_tier": self.remote,
            "drained": self.drained,
            "faults_by_kind": ",".join(f"{k}={n}" for k, n in sorted(self.faults_by_kind.items())),
            **({"findings": " | ".join(self.violations[:3])} if self.violations else {}),
        }


@dataclass
class Prompts:
    normal: list[list[int]]
    long: list[list[int]]
    flood: list[list[int]]
    reference: dict[tuple[int, ...], Output] = field(default_factory=dict)

    @classmethod
    def make(cls, cfg: VllmSoakConfig) -> Prompts:
        rng = random.Random(cfg.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, 1000) for _ in range(n)]

        prefixes = [tokens(PREFIX_TOKENS) for _ in range(cfg.families)]
        normal = [p + tokens(SUFFIX_TOKENS) for p in prefixes for _ in range(cfg.suffixes)]
        return cls(
            normal,
            [tokens(LONG_TOKENS) for _ in range(2)],
            [tokens(FLOOD_TOKENS) for _ in range(8)],
        )

    def all(self) -> list[list[int]]:
        return [*self.normal, *self.long, *self.flood]


class Soak:
    def __init__(self, cfg: VllmSoakConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvd-vllm-soak-"))
        self.model = write_model(self.run_dir / "tiny-llama")
        self.prompts = Prompts.make(cfg)
        self.lock = threading.Lock()
        self.violations: list[str] = []
        self.counts: Counter[str] = Counter()
        self.max_request_s = 0.0
        self.slowest = ""  # the slowest batch, and the last fault begun before it
        self.last_fault: tuple[str, float] = ("none", time.monotonic())
        self.fault_log: list[tuple[float, str]] = []  # (monotonic, what), engines' too
        self.counters_total: Counter[str] = Counter()
        self.counters_now: dict[str, int] = {}
        self.stop = threading.Event()
        self.redis: RedisServer | None = None
        self.daemon: DaemonProcess | None = None
        self.engines: list[EngineSlot] = []

    # -- set-up ----------------------------------------------------------------------

    def _reference(self) -> None:
        engine = self._engine(None)
        try:
            for prompt in self.prompts.all():  # one at a time: the soak's batches differ
                (out,) = engine.outputs([prompt], MAX_TOKENS)
                self.prompts.reference[tuple(prompt)] = out
        finally:
            engine.stop()

    def _engine(self, kvd: dict[str, Any] | None, core: int | None = None) -> EngineProcess:
        """An engine process; with `core`, its OpenMP threads on that core alone. Two
        engines whose spinning OpenMP teams share two cores stall each other's steps
        for tens of seconds (a batch of one prompt took 74 s in a first 600 s run)."""
        config = {"model": self.model, "kvd": kvd, "max_model_len": MAX_MODEL_LEN,
                  "num_gpu_blocks": self.cfg.gpu_blocks}  # fmt: skip
        cores = os.cpu_count() or 1
        bind = {} if core is None else {"VLLM_CPU_OMP_THREADS_BIND": str(core % cores)}
        return EngineProcess(config, env=bind)

    def kvd_config(self) -> dict[str, Any]:
        assert self.daemon is not None
        return {"kvd_endpoint": self.daemon.endpoint, "kvd_pool": POOL,
                "kvd_capacity_bytes": self.cfg.pool_blocks * PAGE_BYTES}  # fmt: skip

    def start_daemon(self, restart: str = "warm") -> None:
        cfg = self.cfg
        if self.daemon is None:
            flags = {**TEST_FLAGS, "lease-ms": str(cfg.lease_ms), "log-level": "info",
                     "job-timeout-ms": str(cfg.job_timeout_ms)}  # fmt: skip
            if self.redis is not None:
                flags["remote-url"] = self.redis.url
            self.daemon = DaemonProcess(flags)
        self.daemon.flags["restart"] = restart
        self.daemon.start()

    # -- the run ---------------------------------------------------------------------

    def run(self) -> VllmSoakResult:
        cfg = self.cfg
        remote = cfg.remote and redis_available()
        try:
            self._reference()
            if remote:
                self.redis = RedisServer().start()
            self.start_daemon()
            self.engines = [EngineSlot(self, n) for n in range(2)]
            rss_start = self._rss()
            t0 = time.monotonic()
            threads = [
                threading.Thread(target=e.loop, name=f"engine-{e.index}") for e in self.engines
            ]
            for t in threads:
                t.start()
            plan = FaultPlan(self.rng, cfg.period_s, remote)
            try:
                while time.monotonic() - t0 < cfg.seconds:
                    fault = plan.due(time.monotonic() - t0)
                    if fault is not None:
                        self._apply(fault)
                    self._check_daemon()
                    self._sample()
                    time.sleep(0.2)
            finally:
                self.stop.set()
                for t in threads:
                    t.join(timeout=cfg.request_bound_s + 60)
            seconds = time.monotonic() - t0
            for e in self.engines:
                e.close()
            self._sample()
            ok = self._drained()
            return VllmSoakResult(
                seconds=seconds, requests=self.counts["requests"],
                faults_by_kind={k: n for k, n in self.counts.items() if k in set(Fault)},
                violations=list(self.violations), max_request_s=self.max_request_s,
                slowest=self.slowest,
                request_bound_s=cfg.request_bound_s,
                loaded_blocks=self._total("loaded_blocks"), hit_blocks=self._total("hit_blocks"),
                vllm_loaded_bytes=self.counts["vllm_loaded_bytes"],
                engine_restarts=self.counts["engine_restarts"], remote=remote, drained=ok,
                rss_start_mb=rss_start, rss_end_mb=self._rss(),
                run_dir=str(self.run_dir),
            )  # fmt: skip
        finally:
            for e in self.engines:
                e.close()
            if self.daemon is not None:
                self.daemon.stop()
            if self.redis is not None:
                self.redis.stop()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def violation(self, what: str) -> None:
        with self.lock:
            self.violations.append(what)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n

    def happened(self, what: str) -> None:
        with self.lock:
            self.fault_log.append((time.monotonic(), what))

    def during(self, start: float) -> str:
        """The faults begun since `start`, and the last one before it."""
        with self.lock:
            before = [what for at, what in self.fault_log if at < start][-1:]
            since = [f"+{at - start:.1f}s {what}" for at, what in self.fault_log if at >= start]
        return ", ".join([*(f"before: {b}" for b in before), *since]) or "no fault"

    def timed(self, seconds: float, what: str) -> None:
        with self.lock:
            if seconds > self.max_request_s:
                self.max_request_s = seconds
                fault, at = self.last_fault
                ago = time.monotonic() - seconds - at
                self.slowest = f"{what}, {seconds:.1f} s, began {ago:.1f} s after {fault}"

    def _apply(self, fault: Fault) -> None:
        d = self.daemon
        assert d is not None and d.proc is not None
        self.last_fault = (fault, time.monotonic())
        self.happened(fault)
        if fault in (Fault.DAEMON_KILL_WARM, Fault.DAEMON_KILL_COLD):
            self._sample()
            d.kill()
            self.counters_total.update(self.counters_now)
            self.counters_now = {}
            time.sleep(self.rng.uniform(0.0, 1.5))
            self.start_daemon("warm" if fault == Fault.DAEMON_KILL_WARM else "cold")
        elif fault == Fault.DAEMON_STALL:  # past a lease: sessions roll back meanwhile
            d.proc.send_signal(19)  # SIGSTOP
            time.sleep(self.rng.uniform(1.2, 2.0) * self.cfg.lease_ms / 1000)
            d.proc.send_signal(18)  # SIGCONT
        elif fault == Fault.REMOTE_STALL:
            assert self.redis is not None and self.redis.proc is not None
            self.redis.proc.send_signal(19)
            time.sleep(self.rng.uniform(1.0, 3.0))
            self.redis.proc.send_signal(18)
        else:  # an engine's: it runs it between its requests, and counts it then
            # To an engine that is not starting again (a start takes 30 to 60 s here).
            ready = [e for e in self.engines if not e.restarting] or self.engines
            self.rng.choice(ready).pending.append(fault)
            return
        self.count(fault)

    def _check_daemon(self) -> None:
        """A daemon that died of itself is a violation; it is started again."""
        d = self.daemon
        assert d is not None and d.proc is not None
        if d.proc.poll() is not None:
            self.violation(f"the daemon exited with {d.proc.returncode}: {d.log()[-600:]}")
            self.start_daemon()

    def _sample(self) -> None:
        assert self.daemon is not None
        with contextlib.suppress(KvdError, OSError):  # down or stopped: the last sample stands
            self.counters_now = dict(daemon_stats(self.daemon.endpoint).counters)

    def _rss(self) -> float:
        d = self.daemon
        return rss_mb(d.proc.pid) if d is not None and d.proc is not None else 0.0

    def _total(self, name: str) -> int:
        return self.counters_total[name] + self.counters_now.get(name, 0)

    def _drained(self) -> bool:
        """Nothing pinned or in flight once leases and job deadlines ran out; invariants."""
        assert self.daemon is not None
        cfg = self.cfg
        deadline = time.monotonic() + (2 * cfg.lease_ms + 2 * cfg.job_timeout_ms) / 1000 + 10
        while True:
            try:
                if drained(daemon_stats(self.daemon.endpoint)):
                    problems = invariant_problems(self.daemon.endpoint)
                    for problem in problems:
                        self.violation(f"invariant: {problem}")
                    return not problems
            except KvdError as exc:
                self.violation(f"the daemon did not answer at the end: {exc}")
                return False
            if time.monotonic() > deadline:
                self.violation("pins or stores in flight left after the engines stopped")
                return False
            time.sleep(0.2)


def run_vllm_soak(config: VllmSoakConfig) -> VllmSoakResult:
    """Runs one soak of real vLLM engines; never leaves a process or a segment behind."""
    return Soak(config).run()
