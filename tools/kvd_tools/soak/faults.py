"""Runs in the soak harness: what to break, and when.

    t = 0 ........ restart_at ............................ end - quiet_s ..... end
        kills      SIGKILL daemon, start it               kills             no faults:
        every      again on the same runtime dir          every             the last steps
        period     (clients reconnect by themselves)      period            run clean

Every `period` seconds (uniform in the range) one client process gets
SIGKILL: a scheduler actor, the engine's scheduler process (its ranks exit
after it), or one engine rank (the engine starts it again). A killed actor or
engine is started again after a random delay, sometimes longer than a lease,
so the daemon rolls the dead session back before its replacement arrives.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class Fault(StrEnum):
    KILL_ACTOR = "kill_actor"
    KILL_ENGINE = "kill_engine"
    KILL_WORKER = "kill_worker"
    RESTART_DAEMON = "restart_daemon"


class Targets(Protocol):
    """What the injector acts on (the harness). A kill returns False if nothing was killed."""

    num_actors: int
    world_size: int

    def kill_actor(self, index: int) -> bool: ...

    def kill_engine(self) -> bool: ...

    def kill_worker(self, rank: int) -> bool: ...

    def restart_daemon(self) -> None: ...

    def start_actor(self, index: int) -> None: ...

    def start_engine(self) -> None: ...


@dataclass
class FaultInjector:
    rng: random.Random
    seconds: float
    restart_at: float  # seconds into the run: the one daemon restart
    period: tuple[float, float] = (1.5, 4.0)
    max_restart_delay: float = 3.0
    quiet_s: float = 3.0
    weights: tuple[tuple[Fault, int], ...] = (
        (Fault.KILL_ACTOR, 5),
        (Fault.KILL_WORKER, 3),
        (Fault.KILL_ENGINE, 2),
    )
    counts: Counter[Fault] = field(default_factory=Counter)
    _next: float = 0.0
    _daemon_done: bool = False
    _pending: list[tuple[float, str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._next = self.rng.uniform(*self.period)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def tick(self, elapsed: float, targets: Targets) -> None:
        """Applies what is due `elapsed` seconds into the run; call it often."""
        for due, kind, index in list(self._pending):
            if due <= elapsed:
                self._pending.remove((due, kind, index))
                if kind == "actor":
                    targets.start_actor(index)
                else:
                    targets.start_engine()
        if not self._daemon_done and elapsed >= self.restart_at:
            self._daemon_done = True
            targets.restart_daemon()
            self.counts[Fault.RESTART_DAEMON] += 1
        if elapsed < self._next or elapsed >= self.seconds - self.quiet_s:
            return
        self._next = elapsed + self.rng.uniform(*self.period)
        kinds, weights = zip(*self.weights, strict=True)
        fault = self.rng.choices(kinds, weights)[0]
        delay = elapsed + self.rng.uniform(0.0, self.max_restart_delay)
        if fault == Fault.KILL_ACTOR:
            index = self.rng.randrange(targets.num_actors)
            if targets.kill_actor(index):
                self.counts[fault] += 1
                self._pending.append((delay, "actor", index))
        elif fault == Fault.KILL_ENGINE:
            if targets.kill_engine():
                self.counts[fault] += 1
                self._pending.append((delay, "engine", 0))
        elif targets.kill_worker(self.rng.randrange(targets.world_size)):
            self.counts[fault] += 1
