"""Runs in the test and bench process: real `redis-server` processes on free localhost ports.

`RedisServer` is one standalone server; `RedisClusterProcesses` is a Redis
Cluster of `masters` masters, each with `replicas` replicas, made with
`redis-cli --cluster create`. Both run from a temp dir, without persistence,
with the DEBUG command enabled (the tests slow the server with `DEBUG
SLEEP`), and are killed by `stop()` (or leaving the `with` block). The
binaries come from the system (`apt-get install redis-server`; `.ci/run`
and the Makefile install it); `available()` says whether they are there.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free now, whose cluster bus port (+10000, as Redis Cluster uses)
    is free too; so at most 55535."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20_000, 55_535)
        if _free(port) and _free(port + 10_000):
            return port
    raise RuntimeError("no free port pair for redis-server")


def _cli(port: int, *args: str, timeout: float = 10) -> str:
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return out.stdout + out.stderr


class RedisServer:
    def __init__(self, port: int | None = None, *extra: str, workdir: Path | None = None) -> None:
        self.port = port or free_port()
        self.extra = list(extra)
        self._own_dir = workdir is None
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="kvd-redis"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> RedisServer:
        args = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--enable-debug-command", "yes",
            "--dir", str(self.dir), "--logfile", str(self.dir / f"redis-{self.port}.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited: {self.log()[-2000:]}")
            if "PONG" in _cli(self.port, "ping", timeout=2):
                return
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not answer")

    def cli(self, *args: str, timeout: float = 10) -> str:
        return _cli(self.port, *args, timeout=timeout)

    def log(self) -> str:
        try:
            return (self.dir / f"redis-{self.port}.log").read_text()
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterProcesses:
    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-rcluster"))
        self.replicas = replicas
        # validity factor 0: a replica always takes over, however long its link
        # to its master was down (a test kills masters soon after the start).
        flags = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(node_timeout_ms),
                 "--cluster-replica-validity-factor", "0"]  # fmt: skip
        self.nodes = [
            RedisServer(None, *flags, workdir=self.dir / str(i))
            for i in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterProcesses:
        try:
            for node in self.nodes:
                node.start(wait=False)
            for node in self.nodes:
                node.wait_ready()
            hosts = [f"127.0.0.1:{n.port}" for n in self.nodes]
            out = _cli(
                self.nodes[0].port, "--cluster", "create", *hosts,
                "--cluster-replicas", str(self.replicas), "--cluster-yes", timeout=60,
            )  # fmt: skip
            if "[OK] All 16384 slots covered" not in out:
                raise RuntimeError(f"redis-cli --cluster create failed: {out[-2000:]}")
            self.wait_ok()
            self._wait_replicas_linked()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_replicas_linked(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [n.cli("info", "replication") for n in self.nodes]
            replicas = [i for i in infos if "role:slave" in i]
            if len(replicas) == len(self.nodes) - len(self.nodes) // (1 + self.replicas) and all(
                "master_link_status:up" in i for i in replicas
            ):
                return
            time.sleep(0.1)
        raise TimeoutError("the cluster's replicas did not link to their masters")

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says the cluster is ok and agrees on the masters."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.live()):
                return
            time.sleep(0.1)
        raise TimeoutError("the redis cluster did not reach cluster_state:ok")

    def wait_failed_over(self, dead: RedisServer, timeout: float = 60) -> None:
        """Until the live nodes hold `dead` as failed and the cluster is ok again
        (its replica took its slots over)."""
        deadline = time.monotonic() + timeout
        mark = f"127.0.0.1:{dead.port}@"
        while time.monotonic() < deadline:
            views = [n.cli("cluster", "nodes") for n in self.live()]
            failed = all(
                any(mark in line and " fail " in f" {line.split()[2].replace(',', ' ')} "
                    for line in view.splitlines())
                for view in views
            )  # fmt: skip
            if failed and len(self.masters()) == len(self.nodes) // (1 + self.replicas):
                self.wait_ok(max(1.0, deadline - time.monotonic()))
                return
            time.sleep(0.1)
        raise TimeoutError(f"no failover of {dead.port} within {timeout} s")

    def masters(self) -> list[RedisServer]:
        """The live nodes that are masters now."""
        return [n for n in self.live() if "role:master" in n.cli("info", "replication")]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterProcesses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
