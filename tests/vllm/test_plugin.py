"""Runs in the test process: real vLLM 0.32 (CPU build) on a real kvd daemon.

Each engine is a child process (`tests.vllm.engine_child`) on a tiny Llama
with dummy weights; engines are shared across tests where they can be, since
one takes 30 to 60 s to start here. The reference is the same engine without
a connector: kvd must change no token.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_tools.launcher import DaemonProcess
from tests.vllm.engine_child import write_model

ROOT = Path(__file__).resolve().parents[2]
# Prompts that share a 256-token prefix (8 blocks of 32), then differ.
PREFIX = [(i * 37) % 1000 + 3 for i in range(256)]
PROMPTS = [PREFIX + [(i * 11 + j * 101) % 1000 + 3 for i in range(96)] for j in range(3)]


class Engine:
    """One vLLM engine process speaking JSON lines."""

    def __init__(self, model: str, kvd: dict[str, Any] | None, tp: int = 1) -> None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "auto"}
        config = {"model": model, "kvd": kvd, "tp": tp}
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="kvd-vllm-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.engine_child", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env=env,
            start_new_session=True,  # vLLM's engine core and workers go with it on stop
        )
        assert self._read(timeout=300) == {"ready": True}

    def log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def _read(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine exited with {self.proc.poll()}:\n{self.log_tail()}")
            line = line.strip()
            if line.startswith("{"):
                return json.loads(line)
        raise TimeoutError(f"engine did not answer:\n{self.log_tail()}")

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        reply = self.ask({"prompts": prompts, "max_tokens": max_tokens})
        tokens: list[list[int]] = reply["tokens"]
        return tokens

    def ask(self, cmd: dict[str, Any], timeout: float = 120) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def reset_prefix_cache(self) -> None:
        assert self.ask({"reset_prefix_cache": True}) == {"ok": True}

    def stop(self) -> None:
        """Stops the engine and every process vLLM started for it (its process group)."""
        stop_group(self.proc)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to `proc`'s process group, SIGKILL to what is left after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine core and workers too
    proc.wait()


def counters(daemon: DaemonProcess) -> dict[str, int]:
    conn = Connection(daemon.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        stats = conn.call(p.Stats)
        assert isinstance(stats, p.StatsResult)
        return dict(stats.counters)
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    """The tokens vLLM gives without any connector."""
    engine = Engine(model, None)
    try:
        return engine.generate(PROMPTS)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(lease_ms="3000", max_total_bytes="1GiB").start()
    try:
        yield d
    finally:
        d.stop()


def kvd_config(daemon: DaemonProcess) -> dict[str, Any]:
    return {"kvd_endpoint": daemon.endpoint, "kvd_capacity_bytes": 64 << 20}


def test_same_tokens_hits_after_a_reset_and_across_an_engine_restart(
    model: str, reference: list[list[int]], daemon: DaemonProcess
) -> None:
    first = Engine(model, kvd_config(daemon))
    try:
        assert first.generate(PROMPTS) == reference
        stored = counters(daemon)
        assert stored.get("blocks_stored", 0) >= 8  # the shared prefix, at least
        first.reset_prefix_cache()  # vLLM's own cache is empty now
        assert first.generate(PROMPTS) == reference
        after = counters(daemon)
        assert after.get("hit_blocks", 0) >= 8 * len(PROMPTS)
        assert after.get("loaded_blocks", 0) >= 8
        # A second engine at the same time shares the pool: it hits what the first stored.
        second = Engine(model, kvd_config(daemon))
        try:
            before = counters(daemon)
            assert second.generate(PROMPTS[:1]) == reference[:1]
            both = counters(daemon)
            assert both["hit_blocks"] - before.get("hit_blocks", 0) >= 8
            assert both["loaded_blocks"] - before.get("loaded_blocks", 0) >= 8
        finally:
            second.stop()
    finally:
        first.stop()
    # A new engine process on the same daemon serves its first prefix from kvd.
    restarted = Engine(model, kvd_config(daemon))
    try:
        before = counters(daemon)
        assert restarted.generate(PROMPTS) == reference
        now = counters(daemon)
        assert now["hit_blocks"] - before["hit_blocks"] >= 8 * len(PROMPTS)
        assert now["loaded_blocks"] - before["loaded_blocks"] >= 8
    finally:
        restarted.stop()


def test_daemon_down_at_start_then_killed_mid_run(
    model: str, reference: list[list[int]], tmp_path: Path
) -> None:
    d = DaemonProcess(lease_ms="3000", max_total_bytes="1GiB")  # not started yet
    engine = Engine(model, {"kvd_endpoint": d.endpoint, "kvd_capacity_bytes": 64 << 20})
    try:
        assert engine.generate(PROMPTS) == reference  # no daemon: lookups miss
        d.start()
        deadline = time.monotonic() + 30
        while counters(d).get("blocks_stored", 0) == 0:  # the plug-in reconnects by itself
            assert time.monotonic() < deadline, "the plug-in never reconnected"
            engine.reset_prefix_cache()
            assert engine.generate(PROMPTS) == reference
        assert d.proc is not None
        d.kill(signal.SIGKILL)
        t0 = time.monotonic()
        engine.reset_prefix_cache()
        assert engine.generate(PROMPTS) == reference  # daemon gone mid-run
        assert time.monotonic() - t0 < 60
        d.start()
        engine.reset_prefix_cache()
        assert engine.generate(PROMPTS) == reference
    finally:
        engine.stop()
        d.stop()


def test_tensor_parallel_two_ranks_share_one_sharded_pool(
    daemon: DaemonProcess, model: str
) -> None:
    """TP=2 through vLLM's multiprocessing executor on the CPU platform."""
    plain = Engine(model, None, tp=2)
    try:
        reference = plain.generate(PROMPTS)
    finally:
        plain.stop()
    engine = Engine(model, {**kvd_config(daemon), "kvd_pool": "tp2"}, tp=2)
    try:
        assert engine.generate(PROMPTS) == reference
        engine.reset_prefix_cache()
        before = counters(daemon)
        assert engine.generate(PROMPTS) == reference
        assert counters(daemon)["hit_blocks"] - before["hit_blocks"] >= 8 * len(PROMPTS)
        conn = Connection(daemon.endpoint, role="admin", keeper=False, timeout_ms=2000)
        conn.connect()
        try:
            pools = conn.call(p.Pools)
            assert isinstance(pools, p.PoolsResult)
            (info,) = [pi for pi in pools.pools if pi.name == "tp2"]
            assert info.layout.world_size == 2 and not info.layout.replicated
            assert info.blocks_ready >= 8
        finally:
            conn.close()
    finally:
        engine.stop()


def test_the_openai_server_with_the_readme_command(daemon: DaemonProcess, model: str) -> None:
    """`python -m vllm.entrypoints.openai.api_server` as the README says, one completion."""
    import socket
    import urllib.request

    from tests.vllm.engine_child import kv_transfer_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--load-format", "dummy", "--skip-tokenizer-init", "--gpu-memory-utilization", "0.1",
            "--max-model-len", "2048", "--block-size", "32", "--enforce-eager",
            "--host", "127.0.0.1", "--port", str(port),
            "--kv-transfer-config", json.dumps(kv_transfer_config({"kvd_capacity_bytes": 64 << 20})),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "KVD_ENDPOINT": daemon.endpoint},
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server never became healthy"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        before = counters(daemon).get("blocks_stored", 0)
        prompt = [(i * 13) % 1000 + 3 for i in range(224)]  # blocks no other test stored
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4,
                           "temperature": 0}).encode()  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer = json.loads(reply.read())
        assert answer["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 10
        while counters(daemon).get("blocks_stored", 0) == before:  # stores land after the step
            assert time.monotonic() < deadline, "nothing reached kvd"
            time.sleep(0.2)
    finally:
        stop_group(server)
