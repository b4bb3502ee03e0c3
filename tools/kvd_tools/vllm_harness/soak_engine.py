"""Runs in the vLLM soak's harness: one engine of the soak and the thread that drives it.

Between its requests the thread runs the faults the harness handed it
(`kvd_tools.vllm_harness.vllm_faults`): vLLM's connector reset, an engine
restart, an abort, the longest prompt, a flood that evicts the other
engine's blocks. Every answer is checked against the reference; an engine
that died or raised is a violation, and is started again.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from kvd_tools.vllm_harness.driver import EngineProcess, differences
from kvd_tools.vllm_harness.vllm_faults import SLOW, Fault

if TYPE_CHECKING:
    from kvd_tools.vllm_harness.soak import Soak

MAX_TOKENS = 8


class EngineSlot:
    """One kvd engine and the thread that drives it: requests, and its share of faults."""

    def __init__(self, soak: Soak, index: int) -> None:
        self.soak, self.index = soak, index
        self.rng = random.Random(soak.cfg.seed * 100 + index + 1)
        self.pending: list[Fault] = []
        self.restarting = False
        self.engine: EngineProcess | None = soak._engine(soak.kvd_config(), index)
        self.rounds = 0

    def loop(self) -> None:
        soak = self.soak
        # After the stop, the quick faults still queued run too: a fault handed out
        # is a fault run.
        while not soak.stop.is_set() or any(f not in SLOW for f in self.pending):
            fault = self.pending.pop(0) if self.pending else None
            if soak.stop.is_set() and fault in SLOW:
                continue
            try:
                self.step(fault)
            except Exception as exc:  # a dead or wedged engine: a violation, then a new one
                tail = self.engine.log_tail(1500) if self.engine is not None else ""
                soak.violation(f"engine {self.index} ({fault or 'request'}): {exc!r} {tail[-600:]}")
                try:
                    self.restart()
                except Exception as again:  # it does not start: this engine is done
                    soak.violation(f"engine {self.index} did not start again: {again!r}")
                    return

    def step(self, fault: Fault | None) -> None:
        soak, engine = self.soak, self.engine
        assert engine is not None
        bound = soak.cfg.request_bound_s
        if fault is not None:
            soak.count(fault)
            soak.happened(f"engine {self.index} {fault}")
        t0 = time.monotonic()
        if fault == Fault.RESET_CONNECTOR:
            # kvd is off for this engine until it restarts (docs/vllm.md): checked, then restarted
            engine.reset_prefix_cache(reset_connector=True, timeout=bound)
            self.check(self.rng.sample(soak.prompts.normal, 2), t0, fault)
            self.restart()
            return
        if fault == Fault.RESTART_ENGINE:
            self.restart()
            return
        if fault == Fault.ABORT:
            prompts = self.rng.sample(soak.prompts.normal, 3)
            soak.count("aborted", engine.abort(prompts, self.rng.randint(1, 4), 64, timeout=bound))
            soak.timed(time.monotonic() - t0, f"engine {self.index} abort")
            return
        if fault == Fault.LONG_PROMPT:
            prompts = [self.rng.choice(soak.prompts.long)]
        elif fault == Fault.EVICT:  # the other engine's lookups and loads go on meanwhile
            prompts = self.rng.sample(soak.prompts.flood, 2)
        else:
            self.rounds += 1
            if self.rounds % 3 == 0:  # vLLM's own cache emptied: the prefixes come from kvd
                engine.reset_prefix_cache(timeout=bound)
            prompts = self.rng.sample(soak.prompts.normal, self.rng.randint(1, 3))
        self.check(prompts, t0, fault)

    def check(self, prompts: list[list[int]], t0: float, fault: Fault | None) -> None:
        soak, engine = self.soak, self.engine
        assert engine is not None
        got = engine.outputs(prompts, MAX_TOKENS, timeout=soak.cfg.request_bound_s)
        seconds = time.monotonic() - t0
        soak.timed(seconds, f"engine {self.index} {fault or 'batch'} of {len(prompts)}")
        soak.count("requests", len(prompts))
        want = [soak.prompts.reference[tuple(p)] for p in prompts]
        for found in differences(got, want):
            soak.violation(f"engine {self.index}: {found}")
        if seconds > soak.cfg.request_bound_s:
            kvd = [line for line in engine.log_tail(20000).splitlines() if "kvd" in line][-5:]
            soak.violation(
                f"engine {self.index}: a batch took {seconds:.1f} s ({soak.during(t0)}); "
                f"its last kvd log lines: {kvd}"
            )

    def restart(self) -> None:
        """A new engine process on the same pool (the old one stopped first)."""
        self.restarting = True
        try:
            self.close()
            self.soak.count("engine_restarts")
            self.soak.happened(f"engine {self.index} restarting")
            if not self.soak.stop.is_set():
                self.engine = self.soak._engine(self.soak.kvd_config(), self.index)
        finally:
            self.restarting = False

    def close(self) -> None:
        """Stops the engine, first adding what vLLM's own metrics say it loaded from kvd
        (the daemon counts blocks pinned for loads; this counts bytes copied)."""
        if self.engine is None:
            return
        if self.engine.alive:
            try:
                loaded = self.engine.metrics().get("vllm:kv_offload_load_bytes", 0)
                self.soak.count("vllm_loaded_bytes", int(loaded))
            except Exception as exc:  # a wedged engine: its count is lost, not the run
                self.soak.happened(f"engine {self.index}: no metrics at its stop ({exc!r})")
        self.engine.stop()
        self.engine = None
