"""Runs in the test process: READY, WATCHDOG and STOPPING reach NOTIFY_SOCKET."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

from kvd_tools.launcher import DaemonProcess


def test_ready_watchdog_stopping() -> None:
    path = Path(tempfile.mkdtemp(prefix="kvd-n")) / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(10)
    d = DaemonProcess(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
    try:
        d.start()
        seen: list[str] = []
        while not any("READY=1" in m for m in seen) or seen.count("WATCHDOG=1") < 3:
            seen.append(sock.recv(4096).decode())
        assert d.kill(15) == 0
        while "STOPPING=1" not in seen:
            seen.append(sock.recv(4096).decode())
        ready = next(m for m in seen if "READY=1" in m)
        assert "STATUS=listening on" in ready
    finally:
        d.stop()
        sock.close()
        path.unlink(missing_ok=True)
