"""Runs in the test process: READY, WATCHDOG and STOPPING reach NOTIFY_SOCKET,
and the watchdog pings keep systemd's deadline."""

from __future__ import annotations

import socket
import statistics
import struct
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from kvd_tools.launcher import DaemonProcess

# systemd kills a service that goes WATCHDOG_USEC without a ping; the daemon
# pings at half of it (sd_watchdog_enabled(3)). One second leaves a loaded
# 2-core machine half a second of slack on every ping.
WATCHDOG_USEC = 1_000_000
INTERVALS = 6  # pings measured after READY: about three seconds

# Linux's SO_TIMESTAMPNS (asm-generic; the socket module does not name it): the
# kernel stamps each datagram as it arrives, so the intervals are the daemon's,
# not when this process got round to reading them.
SO_TIMESTAMPNS = 35


def receive(sock: socket.socket) -> tuple[str, float]:
    """One datagram and when it arrived, in seconds (kernel time where stamped)."""
    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(16))
    arrived = time.time()
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(value) >= 16:
            sec, nsec = struct.unpack("qq", value[:16])
            arrived = sec + nsec / 1e9
    return data.decode(), arrived


def test_ready_watchdog_stopping() -> None:
    path = Path(tempfile.mkdtemp(prefix="kvd-n")) / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if sys.platform == "linux":
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.bind(str(path))
    sock.settimeout(10)
    d = DaemonProcess(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    try:
        d.start()
        seen: list[tuple[str, float]] = []
        while not any("READY=1" in m for m, _ in seen):
            seen.append(receive(sock))
        pings: list[float] = []
        while len(pings) <= INTERVALS:
            message, at = receive(sock)
            seen.append((message, at))
            if message == "WATCHDOG=1":
                pings.append(at)
        assert d.kill(15) == 0
        while "STOPPING=1" not in [m for m, _ in seen]:
            seen.append(receive(sock))
        sock.settimeout(0.5)  # the daemon has exited: what else it sent is queued
        try:
            while True:
                seen.append(receive(sock))
        except TimeoutError:
            pass
        messages = [m for m, _ in seen]
        ready = next(m for m in messages if "READY=1" in m)
        assert "STATUS=listening on" in ready
        assert "WATCHDOG=1" not in messages[messages.index("STOPPING=1") :]

        usec = WATCHDOG_USEC / 1e6
        intervals = [b - a for a, b in pairwise(pings)]
        shown = [round(i, 3) for i in intervals]
        # systemd's rule: never a whole WATCHDOG_USEC without a ping.
        assert max(intervals) < usec, f"a ping came late for WATCHDOG_USEC={usec}s: {shown}"
        # At about half of it: an asyncio sleep never ends early, so no interval
        # is much under half; and most are close to it.
        assert min(intervals) > 0.45 * usec, f"pings too often: {shown}"
        assert statistics.median(intervals) < 0.65 * usec, f"pings not at half: {shown}"
    finally:
        d.stop()
        sock.close()
        path.unlink(missing_ok=True)
