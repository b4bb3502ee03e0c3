"""Runs in the operator's shell (`kvd bench peers`): LMCache's MP server as a child process.

LMCache (https://github.com/LMCache/LMCache) is the host KV cache that `kvd
bench peers` measures kvd against. Its multi-process mode is the one that
compares with kvd: a server process (`lmcache server`) holds the cache, and
vLLM's `LMCacheMPConnector` (inside each engine) talks to it over ZMQ. Both
the server and the engines that load the connector run in LMCache's own venv
(`make lmcache-venv`: LMCache 0.5.6 pins numpy, protobuf and OpenTelemetry
below what kvd's venv has); this module only starts the server and names the
connector's config, and imports nothing of LMCache.

On a host without a GPU the server's `--supported-transfer-mode auto` picks
the engine-driven path: the vLLM worker gathers its KV pages and hands them
to the server, and back. How depends on `--shm-name`: without it (LMCache's
default) the pages travel pickled over ZMQ; with it the server's L1 is a
POSIX shared-memory segment that the worker copies into and out of, as kvd's
pool is. `transport="shm"` (the bench's default) names one segment per
server and removes it on stop. `--l1-size-gb` is the L1's size, evicted LRU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvd_tools.vllm_harness.driver import stop_group

START_S = 180.0  # the server imports torch and LMCache's extensions: 10 to 40 s here
VENV_ENV = "KVD_LMCACHE_VENV"
DEFAULT_VENV = ".venv-lmcache"  # `make lmcache-venv`, at the checkout's root
# For the server and the engines that load LMCache's connector: no banner, and no
# usage reports to stats.lmcache.ai (LMCache sends them unless told not to).
ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def default_venv() -> Path:
    """LMCache's venv: `$KVD_LMCACHE_VENV`, else `.venv-lmcache` at this checkout's
    root (where `make lmcache-venv` puts it), else in the current directory."""
    if os.environ.get(VENV_ENV):
        return Path(os.environ[VENV_ENV])
    checkout = Path(__file__).resolve().parents[3]  # tools/kvd_tools/bench/ -> root
    for root in (checkout, Path.cwd()):
        if (root / DEFAULT_VENV / "bin" / "python").exists():
            return root / DEFAULT_VENV
    return checkout / DEFAULT_VENV


def missing(venv: Path) -> str | None:
    """Why `venv` cannot run LMCache's side of the bench, or None when it can."""
    for tool in ("python", "lmcache"):
        if not (venv / "bin" / tool).exists():
            return f"no LMCache venv at {venv} (no bin/{tool}); `make lmcache-venv` builds it"
    return None


def free_port() -> int:
    """A TCP port nothing listens on now (the bench's servers each take three)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LMCacheServer:
    """`lmcache server` on private ports, stopped with its whole process group."""

    def __init__(
        self,
        venv: Path,
        l1_gb: float,
        extra_args: list[str] | None = None,
        transport: str = "shm",
    ) -> None:
        self.port, self.http_port = free_port(), free_port()
        # LMCache creates /dev/shm/lmcache_l1_pool_<name> for `--shm-name <name>`.
        self.shm_name = f"kvd-bench-{os.getpid()}-{self.port}" if transport == "shm" else ""
        self.args = [
            str(venv / "bin" / "lmcache"), "server",
            "--l1-size-gb", f"{l1_gb:g}",
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto",
            "--host", "localhost",
            "--port", str(self.port),
            "--http-host", "127.0.0.1",
            "--http-port", str(self.http_port),
            "--prometheus-port", str(free_port()),
            *(["--shm-name", self.shm_name] if self.shm_name else []),
            *(extra_args or []),
        ]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="kvd-lmcache-", suffix=".log", delete=False
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LMCacheServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        env = {**os.environ, **ENV, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its worker threads and plug-ins go with it
        )
        deadline = time.monotonic() + START_S
        url = f"http://127.0.0.1:{self.http_port}/healthcheck"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"lmcache server exited with {self.proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"lmcache server did not answer {url} in {START_S} s:\n{tail}")

    def kv_transfer(self) -> dict[str, Any]:
        """vLLM's `kv_transfer_config` for an engine that caches in this server."""
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://localhost",
                "lmcache.mp.port": self.port,
            },
        }

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            stop_group(self.proc)
        if self.shm_name:  # a killed server leaves its segment (the size of its L1)
            for name in (self.shm_name, f"lmcache_l1_pool_{self.shm_name}"):
                Path("/dev/shm", name).unlink(missing_ok=True)
        if not self.log.closed:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
