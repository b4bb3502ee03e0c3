"""Runs in the soak harness: the daemon and the client processes that the faults act on.

    Fleet ── spawns ──> actor 0 .. n-1      (.actors)             pool "soak"
      │                 engine + ranks 0, 1 (.engine, .rank)      pool "soak"
      │                 twin                (.twin)               the engine's id, pool "soak-twin"
      │                 timeout scheduler   (.timeout_scheduler)  the engine's id, pool "soak"
      └── the daemon: SIGKILL and start again; SIGSTOP, later SIGCONT

The fleet is the fault injector's `Targets`. A stall tells the clients the
daemon is stopped (`Tally.stalled`, so the timeout scheduler stores then)
and excuses, until two leases and two job timeouts after it ends, jobs the
daemon fails although every rank acked them (`Tally.excuse_until`): a stall
lets every lease lapse. So does the restart.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

from kvd_client.errors import KvdError
from kvd_tools.launcher import DaemonProcess
from kvd_tools.soak.actors import actor_main
from kvd_tools.soak.engine import engine_main
from kvd_tools.soak.probes import daemon_stats, is_spawned_child, parent_of
from kvd_tools.soak.tally import Tally
from kvd_tools.soak.timeout_scheduler import timeout_scheduler_main
from kvd_tools.soak.twin import twin_main
from kvd_tools.soak.workload import WORLD_SIZE

# A stall waits until the engine's ranks run jobs (not while they restart), so
# that it catches the engine's requests and the timeout scheduler's store finds
# ranks to push to.
ENGINE_ACTIVE_S = 0.5


class Fleet:
    def __init__(
        self,
        ctx: SpawnContext,
        tally: Tally,
        daemon: DaemonProcess,
        rng: random.Random,
        num_actors: int,
        wait_s: float,
        excuse_s: float,
    ) -> None:
        self.ctx, self.tally, self.daemon, self.rng = ctx, tally, daemon, rng
        self.num_actors = num_actors
        self.world_size = WORLD_SIZE
        self.wait_s = wait_s
        self.excuse_s = excuse_s
        self.ready_before_restart: dict[str, int] = {}  # pool -> blocks ready at the SIGKILL
        # Tally slots: actors, the engine, its ranks, the twin, the timeout scheduler.
        self.engine_slot = num_actors
        self.twin_slot = num_actors + 1 + WORLD_SIZE
        self.timeout_slot = self.twin_slot + 1
        self.actors: list[BaseProcess | None] = [None] * num_actors
        self.engine: BaseProcess | None = None
        self.twin: BaseProcess | None = None
        self.timeouts: BaseProcess | None = None
        self.killed: set[int] = set()  # pids SIGKILLed on purpose
        self.stalled = False
        self._excused_until = 0.0

    def _excuse(self, until: float) -> None:
        self._excused_until = max(self._excused_until, until)
        self.tally.excuse_until(self._excused_until)

    @staticmethod
    def num_slots(num_actors: int) -> int:
        """Tally slots of the clients, and one more for the harness (the last)."""
        return num_actors + 1 + WORLD_SIZE + 2 + 1

    def _spawn(
        self, main: Callable[..., None], slot: int, name: str, *extra: object
    ) -> BaseProcess:
        args = (self.tally, slot, self.daemon.endpoint, self.rng.randrange(1 << 32), *extra)
        proc = self.ctx.Process(target=main, args=args, name=name)
        proc.start()
        return proc

    def start_all(self) -> None:
        for i in range(self.num_actors):
            self.start_actor(i)
        self.start_engine()
        self.start_twin()
        self.timeouts = self._spawn(timeout_scheduler_main, self.timeout_slot, "timeouts")

    def start_actor(self, index: int) -> None:
        self.actors[index] = self._spawn(actor_main, index, f"actor{index}")

    def start_engine(self) -> None:
        self.engine = self._spawn(engine_main, self.engine_slot, "engine", self.wait_s)

    def start_twin(self) -> None:
        self.twin = self._spawn(twin_main, self.twin_slot, "twin", self.wait_s)

    # -- faults ----------------------------------------------------------------

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

    def kill_twin(self) -> bool:
        if not self._kill(self.twin):
            return False
        self.twin = None
        return True

    def kill_worker(self, rank: int) -> bool:
        pid = self.tally.worker_pid(rank)
        engine = self.engine
        if engine is None or pid <= 0 or parent_of(pid) != engine.pid:
            return False
        os.kill(pid, signal.SIGKILL)
        return True

    def arm_reconnect(self, rank: int) -> bool:
        return self.tally.arm_reconnect(rank)

    def arm_leave(self) -> bool:
        return self.twin is not None and self.tally.arm_leave()

    def restart_daemon(self) -> None:
        """SIGKILL, then start again on the same runtime dir: a warm restart (SPEC 13).

        The ready blocks of each pool just before the kill go to
        `ready_before_restart`; the harness compares them with what the new
        daemon adopted (its log)."""
        self.resume_daemon()
        self._excuse(time.monotonic() + self.excuse_s + 5)
        with contextlib.suppress(KvdError):  # no answer: nothing to compare with
            stats = daemon_stats(self.daemon.endpoint)
            self.ready_before_restart = {pi.name: pi.blocks_ready for pi in stats.pools}
        self.daemon.kill(signal.SIGKILL)
        self.daemon.start()

    def stall_daemon(self) -> bool:
        proc = self.daemon.proc
        if proc is None or proc.poll() is not None or self.stalled:
            return False
        if not self.tally.engine_active(ENGINE_ACTIVE_S):
            return False  # the engine is restarting: the stall would miss its paths
        self.tally.excuse_until(time.monotonic() + 3600)  # until it ends, at least
        os.kill(proc.pid, signal.SIGSTOP)
        self.stalled = True
        self.tally.set_stalled(True)
        return True

    def resume_daemon(self) -> None:
        if not self.stalled:
            return
        proc = self.daemon.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        self.stalled = False
        self.tally.set_stalled(False)
        self._excuse(time.monotonic() + self.excuse_s)

    # -- watching and stopping -------------------------------------------------

    def crashed(self) -> list[str]:
        """Clients that exited by themselves (not by our SIGKILL), started again."""
        found = []
        for i, proc in enumerate(self.actors):
            if proc is not None and not proc.is_alive() and proc.pid not in self.killed:
                found.append(f"actor {i} exited by itself with code {proc.exitcode}")
                self.start_actor(i)
        for name, proc, start in (
            ("the engine", self.engine, self.start_engine),
            ("the twin", self.twin, self.start_twin),
        ):
            if proc is not None and not proc.is_alive() and proc.pid not in self.killed:
                found.append(f"{name} exited by itself with code {proc.exitcode}")
                start()
        proc = self.timeouts
        if proc is not None and not proc.is_alive() and proc.pid not in self.killed:
            found.append(f"the timeout scheduler exited by itself with code {proc.exitcode}")
            self.timeouts = self._spawn(timeout_scheduler_main, self.timeout_slot, "timeouts")
        return found

    def _clients(self) -> list[BaseProcess | None]:
        return [*self.actors, self.engine, self.twin, self.timeouts]

    def stop_clients(self) -> float:
        """Stops every client: about half gracefully (Goodbye), the rest by SIGKILL.

        Returns when the last client was killed (time.monotonic()).
        """
        self.resume_daemon()
        self.tally.stop()
        procs = self._clients()
        for proc in procs:
            if self.rng.random() < 0.5:
                self._kill(proc)
        stopped = time.monotonic()
        for proc in procs:
            if proc is not None:
                proc.join(timeout=30)
                if self._kill(proc):
                    stopped = time.monotonic()
        self.kill_orphans()
        return stopped

    def kill_orphans(self) -> None:
        """Ranks whose engine was SIGKILLed exit by themselves; make sure of it."""
        for rank in range(WORLD_SIZE):
            pid = self.tally.worker_pid(rank)
            deadline = time.monotonic() + 5
            while pid > 0 and parent_of(pid) != -1 and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid > 0 and parent_of(pid) != -1 and is_spawned_child(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def kill_all(self) -> None:
        self.resume_daemon()
        self.tally.stop()
        for proc in self._clients():
            self._kill(proc)
        self.kill_orphans()
