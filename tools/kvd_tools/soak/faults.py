"""Runs in the soak harness: what to break, and when.

    t = 0 ........ restart_at ... + settle_s ................ end - quiet_s ..... end
        faults     SIGKILL daemon, start it   each new kind      faults            no faults:
        every      again on the same          at least once,     every             the last steps
        period     runtime dir                then at random     period            run clean

Every `period` seconds (uniform in the range) one fault, by `weights`:

    kill_actor          SIGKILL a scheduler actor; started again after 0 to 3 s
    kill_engine         SIGKILL the TP engine's scheduler (its ranks exit after it)
    kill_worker         SIGKILL one engine rank (the engine starts it again)
    stall_daemon        SIGSTOP the daemon for 1 to 3 s (the first two 1 to 1.2 s),
                        then SIGCONT: requests time out, clients reconnect, leases
                        lapse; the timeout scheduler's store lands in it
                        (timeout_store)
    reconnect_worker    arm one engine rank: it reconnects during its next store
    leave_second_pool   arm the twin: its workers (the engine's id, on another
                        pool) say goodbye while an engine job runs
    kill_second_pool    SIGKILL the twin; started again after 0 to 3 s

A killed process is started again after a random delay, sometimes longer
than a lease, so the daemon rolls the dead session back before its
replacement arrives. An armed fault fires in the client, which counts it;
so does the timeout scheduler's store (`SoakResult.faults_by_kind` merges
them with `counts`). No stall comes near the daemon restart or the end, or
while the engine restarts its ranks (the fleet refuses it then).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


def _ignore(line: str) -> None:
    pass


class Fault(StrEnum):
    KILL_ACTOR = "kill_actor"
    KILL_ENGINE = "kill_engine"
    KILL_WORKER = "kill_worker"
    RESTART_DAEMON = "restart_daemon"
    STALL_DAEMON = "stall_daemon"
    RECONNECT_WORKER = "reconnect_worker"
    LEAVE_SECOND_POOL = "leave_second_pool"
    KILL_SECOND_POOL = "kill_second_pool"
    TIMEOUT_STORE = "timeout_store"


# Each of these comes at least once soon after the daemon restart, so that a
# short run reaches every path too.
NEW_KINDS = (
    Fault.STALL_DAEMON,
    Fault.RECONNECT_WORKER,
    Fault.LEAVE_SECOND_POOL,
    Fault.KILL_SECOND_POOL,
)


class Targets(Protocol):
    """What the injector acts on (the fleet). A fault returns False if it hit nothing."""

    num_actors: int
    world_size: int

    def kill_actor(self, index: int) -> bool: ...

    def kill_engine(self) -> bool: ...

    def kill_worker(self, rank: int) -> bool: ...

    def kill_twin(self) -> bool: ...

    def restart_daemon(self) -> None: ...

    def stall_daemon(self) -> bool: ...

    def resume_daemon(self) -> None: ...

    def arm_reconnect(self, rank: int) -> bool: ...

    def arm_leave(self) -> bool: ...

    def start_actor(self, index: int) -> None: ...

    def start_engine(self) -> None: ...

    def start_twin(self) -> None: ...


@dataclass
class FaultInjector:
    rng: random.Random
    seconds: float
    restart_at: float  # seconds into the run: the one daemon restart
    period: tuple[float, float] = (1.5, 4.0)
    max_restart_delay: float = 3.0
    stall_s: tuple[float, float] = (1.0, 3.0)
    # The first two stalls are short: the engine ranks' sessions outlive them, so the
    # timed-out store's job reaches live ranks, which must refuse it unstarted.
    first_stall_s: tuple[float, float] = (1.0, 1.2)
    settle_s: float = 3.0  # after the restart, before the new kinds' first turn
    quiet_s: float = 3.0
    weights: tuple[tuple[Fault, int], ...] = (
        (Fault.KILL_ACTOR, 5),
        (Fault.KILL_WORKER, 3),
        (Fault.KILL_ENGINE, 2),
        (Fault.STALL_DAEMON, 2),
        (Fault.RECONNECT_WORKER, 2),
        (Fault.LEAVE_SECOND_POOL, 2),
        (Fault.KILL_SECOND_POOL, 1),
    )
    log: Callable[[str], None] = _ignore  # one line per fault applied or armed
    counts: Counter[Fault] = field(default_factory=Counter)  # applied by the harness
    armed: Counter[Fault] = field(default_factory=Counter)  # handed to a client to fire
    _next: float = 0.0
    _daemon_done: bool = False
    _stalled_until: float = -1.0
    # The short stall twice: its timed-out store reaches live ranks only when no
    # engine restart or reconnect comes between (one chance failed a CI run).
    _first: list[Fault] = field(default_factory=lambda: [*NEW_KINDS, Fault.STALL_DAEMON])
    _pending: list[tuple[float, str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._next = self.rng.uniform(*self.period)
        self.rng.shuffle(self._first)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def stalled(self) -> bool:
        return self._stalled_until >= 0

    def tick(self, elapsed: float, targets: Targets) -> None:
        """Applies what is due `elapsed` seconds into the run; call it often."""
        for due, kind, index in list(self._pending):
            if due <= elapsed:
                self._pending.remove((due, kind, index))
                self.log(f"{elapsed:8.3f} start {kind} {index}")
                if kind == "actor":
                    targets.start_actor(index)
                elif kind == "engine":
                    targets.start_engine()
                else:
                    targets.start_twin()
        if self.stalled and elapsed >= self._stalled_until:
            self._stalled_until = -1.0
            self.log(f"{elapsed:8.3f} resume daemon")
            targets.resume_daemon()
        if not self._daemon_done and elapsed >= self.restart_at:
            self._daemon_done = True
            targets.restart_daemon()
            self.log(f"{elapsed:8.3f} {Fault.RESTART_DAEMON}")
            self.counts[Fault.RESTART_DAEMON] += 1
        if elapsed < self._next or elapsed >= self.seconds - self.quiet_s:
            return
        self._next = elapsed + self.rng.uniform(*self.period)
        if self._first and self._daemon_done and elapsed >= self.restart_at + self.settle_s:
            fault = self._first[0]
        else:
            kinds, weights = zip(*self.weights, strict=True)
            fault = self.rng.choices(kinds, weights)[0]
        detail = self._apply(fault, elapsed, targets)
        if detail is not None:
            self.log(f"{elapsed:8.3f} {fault} {detail}".rstrip())
            if fault in self._first:
                self._first.remove(fault)

    def _apply(self, fault: Fault, elapsed: float, targets: Targets) -> str | None:
        """Applies or arms `fault`; what it hit (for the log), None if nothing."""
        delay = elapsed + self.rng.uniform(0.0, self.max_restart_delay)
        if fault == Fault.STALL_DAEMON:
            return self._stall(elapsed, targets)
        if fault in (Fault.RECONNECT_WORKER, Fault.LEAVE_SECOND_POOL):
            rank = self.rng.randrange(targets.world_size)
            if fault == Fault.RECONNECT_WORKER:
                armed, what = targets.arm_reconnect(rank), f"armed rank {rank}"
            else:
                armed, what = targets.arm_leave(), "armed"
            if not armed:
                return None
            self.armed[fault] += 1
            return what
        again: tuple[str, int] | None = None
        if fault == Fault.KILL_ACTOR:
            index = self.rng.randrange(targets.num_actors)
            done, what, again = targets.kill_actor(index), f"actor {index}", ("actor", index)
        elif fault == Fault.KILL_ENGINE:
            done, what, again = targets.kill_engine(), "", ("engine", 0)
        elif fault == Fault.KILL_WORKER:
            rank = self.rng.randrange(targets.world_size)
            done, what = targets.kill_worker(rank), f"rank {rank}"
        else:
            done, what, again = targets.kill_twin(), "", ("twin", 0)
        if not done:
            return None
        self.counts[fault] += 1
        if again is not None:
            self._pending.append((delay, *again))
            what += f" (start again at {delay:.3f})"
        return what

    def _stall(self, elapsed: float, targets: Targets) -> str | None:
        first = Fault.STALL_DAEMON in self._first
        seconds = self.rng.uniform(*(self.first_stall_s if first else self.stall_s))
        until = elapsed + seconds
        near_restart = not self._daemon_done and until + self.settle_s >= self.restart_at
        if self.stalled or near_restart or until >= self.seconds - self.quiet_s:
            return None
        if not targets.stall_daemon():
            return None
        self._stalled_until = until
        self.counts[Fault.STALL_DAEMON] += 1
        return f"for {seconds:.2f} s"
