"""Runs in the operator's shell (bench, demo) and in tests: a kvd daemon as a child process.

Starts `python -m kvd serve` in a fresh temp runtime dir, waits until it
answers, and on `stop()` terminates it and removes every segment it listed,
even after a SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import posix_ipc

from kvd_client.connection import Connection
from kvd_client.errors import KvdError
from kvd_client.paths import read_admin_token

# Short leases and timeouts so that tests see rollbacks quickly.
TEST_FLAGS = {
    "lease-ms": "600",
    "job-timeout-ms": "3000",
    "max-total-bytes": "1GiB",
    "default-pool-bytes": "16MiB",
    "log-level": "debug",
    "metrics-addr": "none",  # tests run many daemons; one port would clash
}


# A private daemon of a bench or of the demo: quiet, and off the metrics port,
# which a daemon already serving this host may hold.
PRIVATE_FLAGS = {"log-level": "warning", "metrics-addr": "none"}


class DaemonProcess:
    def __init__(
        self, base: dict[str, str] | None = None, env: dict[str, str] | None = None, **flags: str
    ) -> None:
        self.env = env
        # Short path: a Unix socket path must fit in 108 bytes.
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="kvd-t"))
        base = TEST_FLAGS if base is None else base
        self.flags = {**base, **{k.replace("_", "-"): v for k, v in flags.items()}}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.runtime_dir.parent / f"{self.runtime_dir.name}.log"

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.socket_path}"

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "control.sock"

    @property
    def admin_token(self) -> str:
        """The operator token `DropPool` needs (readable: tests run as its owner)."""
        return read_admin_token(self.runtime_dir)

    @property
    def lease_s(self) -> float:
        return int(self.flags.get("lease-ms", "10000")) / 1000

    def start(self, wait: bool = True) -> DaemonProcess:
        args = [sys.executable, "-m", "kvd", "serve", "--runtime-dir", str(self.runtime_dir)]
        for key, value in self.flags.items():
            args += [f"--{key}", value]
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child
        env = {**os.environ, **self.env} if self.env else None
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Returns once the daemon answers a Hello (a socket file alone may be stale)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvd exited with {self.proc.returncode}:\n{self.log()}")
            if not self.socket_path.exists():
                time.sleep(0.02)
                continue
            # A generous timeout: a Hello answered after the client gave up
            # would leave an orphan session until its lease runs out.
            left_ms = int((deadline - time.monotonic()) * 1000)
            wait_ms = max(min(left_ms, 2000), 100)
            conn = Connection(self.endpoint, role="admin", keeper=False, timeout_ms=wait_ms)
            try:
                conn.connect()
                conn.close()
                return
            except KvdError:
                time.sleep(0.02)
        raise RuntimeError(f"kvd did not start within {timeout} s:\n{self.log()}")

    def drop_pool(self, name: str) -> None:
        """`kvd pool drop NAME`: the pool goes at once (with the operator token)."""
        from kvd_client import protocol as p

        conn = Connection(self.endpoint, role="admin", keeper=False)
        conn.connect()
        try:
            conn.call(p.DropPool, name, self.admin_token)
        finally:
            conn.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=20)

    def segments(self) -> list[str]:
        try:
            return (self.runtime_dir / "segments").read_text().split()
        except FileNotFoundError:
            return []

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name in self.segments():  # a test that SIGKILLed the daemon leaves these
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if os.environ.get("KVD_KEEP_LOGS") is None:
            self.log_path.unlink(missing_ok=True)
