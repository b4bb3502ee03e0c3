"""Runs in the vLLM soak's harness: which fault comes when (`kvd_tools.vllm_harness.soak`).

Every `period` seconds (uniform in the range) one fault. The first ones go
through every kind once, in a shuffled order but the engine restarts last,
so a short run reaches each path; then they come at random by `WEIGHTS`:

    daemon_kill_warm   SIGKILL the daemon; start it again (warm: it adopts its pool)
    daemon_kill_cold   SIGKILL the daemon; start it again cold (an empty pool, a new
                       generation: completions of the old one must complete nothing)
    daemon_stall       SIGSTOP the daemon for 1.2 to 2 leases, then SIGCONT
    remote_stall       SIGSTOP redis-server for 1 to 3 s (with a remote tier)
    reset_connector    vLLM's reset_prefix_cache(reset_connector=True) in one engine,
                       then its answers are checked and it is started again
    restart_engine     one engine process stopped and started again
    evict              one engine runs two prompts of 32 new blocks each: the other
                       engine's blocks are evicted between its lookups and loads
    long_prompt        one engine runs the longest prompt the model takes
    abort              one engine starts three requests and aborts them after 1 to 4 steps
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import StrEnum


class Fault(StrEnum):
    DAEMON_KILL_WARM = "daemon_kill_warm"
    DAEMON_KILL_COLD = "daemon_kill_cold"
    DAEMON_STALL = "daemon_stall"
    REMOTE_STALL = "remote_stall"
    RESET_CONNECTOR = "reset_connector"
    RESTART_ENGINE = "restart_engine"
    EVICT = "evict"
    LONG_PROMPT = "long_prompt"
    ABORT = "abort"


# Engine restarts cost 30 to 60 s of this machine's two cores: rarer.
WEIGHTS: dict[Fault, int] = {
    Fault.DAEMON_KILL_WARM: 3,
    Fault.DAEMON_KILL_COLD: 2,
    Fault.DAEMON_STALL: 3,
    Fault.REMOTE_STALL: 2,
    Fault.RESET_CONNECTOR: 1,
    Fault.RESTART_ENGINE: 1,
    Fault.EVICT: 4,
    Fault.LONG_PROMPT: 3,
    Fault.ABORT: 4,
}


# Faults that start an engine process again.
SLOW = frozenset({Fault.RESET_CONNECTOR, Fault.RESTART_ENGINE})


@dataclass
class FaultPlan:
    rng: random.Random
    period: tuple[float, float]
    remote: bool  # without a remote tier, no remote_stall
    _next: float = 0.0
    _first: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._first = [f for f in Fault if self.remote or f != Fault.REMOTE_STALL]
        self.rng.shuffle(self._first)
        # The engine restarts last (`due` pops from the end): each holds its engine
        # 30 to 60 s, and an engine's faults wait for it.
        self._first.sort(key=lambda f: f not in SLOW)
        self._next = self.rng.uniform(*self.period)

    def due(self, elapsed: float) -> Fault | None:
        """The fault due `elapsed` seconds into the run, if one is."""
        if elapsed < self._next:
            return None
        self._next = elapsed + self.rng.uniform(*self.period)
        if self._first:
            return self._first.pop()
        kinds = [f for f in WEIGHTS if self.remote or f != Fault.REMOTE_STALL]
        return self.rng.choices(kinds, [WEIGHTS[f] for f in kinds])[0]
