"""Runs in the bench: a private daemon killed and started again, and the CPU it spends.

`restart` SIGKILLs the daemon and spawns it again on the same runtime dir
(and so the same disk dir), optionally after a simulated host reboot: the
pools' shared-memory segments (and ready tables) that its manifest lists
unlinked first, as a reboot wipes /dev/shm, while files on disk stay. It
returns when the new daemon listens (its control socket a new file), so a
scheduler connects at once, as an engine's would; the time counts from the
spawn.

`cpu_s` reads a process's CPU seconds (user + system, every thread) from
/proc/<pid>/stat; `wait_quiet` waits until it spends next to none (a new
pool's prefault thread or an adoption's policy slices done), so that a
timed phase measures its own work.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import posix_ipc

from kvd_tools.launcher import DaemonProcess

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def daemon_pid(daemon: DaemonProcess) -> int:
    assert daemon.proc is not None
    return daemon.proc.pid


def wait_quiet(pid: int, timeout_s: float = 30.0, window_s: float = 0.2) -> None:
    """Until `pid` spends under a tenth of a core over `window_s` (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = cpu_s(pid)
        time.sleep(window_s)
        if cpu_s(pid) - before < 0.1 * window_s:
            return


def unlink_segments(daemon: DaemonProcess) -> int:
    """Unlinks the shared memory the daemon's manifest lists (a reboot); how many."""
    gone = 0
    for name in daemon.segments():
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)
            gone += 1
    return gone


def wait_for_new_socket(daemon: DaemonProcess, stale: tuple[int, int], t0: float) -> None:
    """Until the new daemon bound its control socket (a new file in place of the
    dead one's): the scheduler then connects at once, as an engine's would."""
    from kvd_tools.bench.suites import SuiteError

    while True:
        with contextlib.suppress(FileNotFoundError):  # between the unlink and the bind
            st = daemon.socket_path.stat()
            if (st.st_ino, st.st_ctime_ns) != stale:
                return
        if daemon.proc is not None and daemon.proc.poll() is not None:
            raise SuiteError(f"the daemon exited with {daemon.proc.returncode}")
        if time.monotonic() - t0 > 120:
            raise SuiteError("the daemon did not listen within 120 s of the restart")
        time.sleep(0.002)


def restart(daemon: DaemonProcess, *, reboot: bool = False) -> float:
    """SIGKILL, (with `reboot`, the segments unlinked,) spawn again; returns the
    spawn's time (time.monotonic) once the new daemon listens."""
    daemon.kill(signal.SIGKILL)
    st = daemon.socket_path.stat()  # the dead daemon's socket file
    if reboot:
        unlink_segments(daemon)
    t0 = time.monotonic()
    daemon.start(wait=False)
    wait_for_new_socket(daemon, (st.st_ino, st.st_ctime_ns), t0)
    return t0
