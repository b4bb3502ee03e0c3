"""Runs in the daemon: systemd's notify protocol (READY, STOPPING, WATCHDOG) over NOTIFY_SOCKET.

A few lines of socket code instead of a dependency: one datagram per state
change to the socket systemd names in `NOTIFY_SOCKET` (a path, or an abstract
name starting with '@'). Without that variable every call is a no-op.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

log = logging.getLogger("kvd.io.notify")


class Notifier:
    def __init__(self, env: Mapping[str, str]) -> None:
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        usec = env.get("WATCHDOG_USEC", "")
        # Ping at half the interval, as sd_watchdog_enabled(3) advises.
        self.watchdog_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None

    @property
    def enabled(self) -> bool:
        return bool(self._addr)

    def send(self, state: str) -> None:
        if not self._addr:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(state.encode(), self._addr)
        except OSError as exc:
            first = state.split("\n", maxsplit=1)[0]
            log.warning("event=notify_failed state=%s reason=%r", first, exc)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")
