"""Runs in the test process: real vLLM 0.32 (CPU build) on a real kvd daemon.

Each engine is a child process (`kvd_tools.vllm_harness.engine`) on a tiny Llama
with seeded weights of a realistic spread (`write_model`); engines are shared
across tests where they can be, since one takes 30 to 60 s to start here. The
reference is the same engine without a connector: kvd must change no token
and move no top logprob by more than `LOGPROB_TOLERANCE` (`same_outputs`).
That comparison can fail: with every page kvd loads zeroed it does
(`test_the_comparison_fails_when_the_pages_kvd_loads_are_zeroed`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_tools.launcher import DaemonProcess
from kvd_tools.redis_launcher import RedisServer
from kvd_tools.redis_launcher import available as redis_available
from kvd_tools.vllm_harness.driver import (
    LOGPROB_TOLERANCE,
    EngineProcess,
    Output,
    differences,
    largest_difference,
    stop_group,
)
from kvd_tools.vllm_harness.engine import TINY_DEEPSEEK, kv_transfer_config, write_model

ROOT = Path(__file__).resolve().parents[2]
# Prompts that share a 256-token prefix (8 blocks of 32), then differ.
PREFIX = [(i * 37) % 1000 + 3 for i in range(256)]
PROMPTS = [PREFIX + [(i * 11 + j * 101) % 1000 + 3 for i in range(96)] for j in range(3)]


def start_engine(
    model: str, kvd: dict[str, Any] | None, tp: int = 1, *, corrupt_loads: bool = False
) -> EngineProcess:
    return EngineProcess({"model": model, "kvd": kvd, "tp": tp, "corrupt_loads": corrupt_loads})


def same_outputs(got: list[Output], want: list[Output]) -> None:
    """The same greedy tokens, and each top logprob within `LOGPROB_TOLERANCE`."""
    found = differences(got, want)
    assert not found, "\n".join(found[:20])


# MLA's logprobs move this much between engines without any load from kvd (see the test).
MLA_TOLERANCE = 0.25

# A block of the tiny Llama: 2 layers x (K, V) x 2 KV heads x 64 dims x 32 tokens x 2 bytes.
PAGE_BYTES = 2 * 2 * 2 * 64 * 32 * 2


def loaded_bytes(engine: EngineProcess, at_least: float = 0.0) -> float:
    """Bytes vLLM's connector loaded from kvd (vLLM's `vllm:kv_offload_load_bytes`);
    vLLM's stats reach its metrics a little late, so this waits up to 15 s for `at_least`."""
    deadline = time.monotonic() + 15
    while True:
        value = float(engine.metrics().get("vllm:kv_offload_load_bytes", 0.0))
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def pool_info(daemon: DaemonProcess, name: str) -> p.PoolInfo:
    conn = Connection(daemon.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        pools = conn.call(p.Pools)
        assert isinstance(pools, p.PoolsResult)
        (info,) = [pi for pi in pools.pools if pi.name == name]
        return info
    finally:
        conn.close()


def counters(daemon: DaemonProcess) -> dict[str, int]:
    conn = Connection(daemon.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        stats = conn.call(p.Stats)
        assert isinstance(stats, p.StatsResult)
        return dict(stats.counters)
    finally:
        conn.close()


def counters_once_grown(
    daemon: DaemonProcess,
    before: dict[str, int],
    names: tuple[str, ...] = ("hit_blocks", "loaded_blocks"),
    at_least: int = 8,
) -> dict[str, int]:
    """The daemon's counters once each of `names` grew by `at_least` past `before`, or
    after 15 s: lookups from the ready table reach the daemon as batched `Observe`
    reports, sent by a thread of the engine's a few milliseconds later."""
    deadline = time.monotonic() + 15
    while True:
        now = counters(daemon)
        grown = all(now.get(n, 0) - before.get(n, 0) >= at_least for n in names)
        if grown or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model: str) -> list[Output]:
    """The tokens and top logprobs vLLM gives without any connector."""
    engine = start_engine(model, None)
    try:
        return engine.outputs(PROMPTS)
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
    model: str, reference: list[Output], daemon: DaemonProcess
) -> None:
    first = start_engine(model, kvd_config(daemon))
    try:
        same_outputs(first.outputs(PROMPTS), reference)
        stored = counters(daemon)
        assert stored.get("blocks_stored", 0) >= 8  # the shared prefix, at least
        first.reset_prefix_cache()  # vLLM's own cache is empty now
        loaded = loaded_bytes(first)
        same_outputs(first.outputs(PROMPTS), reference)
        after = counters_once_grown(daemon, {})
        assert after.get("hit_blocks", 0) >= 8  # the shared prefix (once: vLLM caches it)
        assert after.get("loaded_blocks", 0) >= 8
        # vLLM's own figures: the bytes were copied in, none was handed back to recompute.
        assert loaded_bytes(first, loaded + 8 * PAGE_BYTES) - loaded >= 8 * PAGE_BYTES
        figures = first.metrics()
        assert figures["vllm:kv_offload_kvd_lookup_hit_keys"] >= 8
        assert figures.get("vllm:kv_offload_kvd_unservable_loads", 0) == 0
        # A second engine at the same time shares the pool: it hits what the first stored.
        second = start_engine(model, kvd_config(daemon))
        try:
            before = counters(daemon)
            same_outputs(second.outputs(PROMPTS[:1]), reference[:1])
            both = counters_once_grown(daemon, before)
            assert both["hit_blocks"] - before.get("hit_blocks", 0) >= 8
            assert both["loaded_blocks"] - before.get("loaded_blocks", 0) >= 8
            assert loaded_bytes(second, 8 * PAGE_BYTES) >= 8 * PAGE_BYTES
        finally:
            second.stop()
    finally:
        first.stop()
    # A new engine process on the same daemon serves its first prefix from kvd.
    restarted = start_engine(model, kvd_config(daemon))
    try:
        before = counters(daemon)
        same_outputs(restarted.outputs(PROMPTS), reference)
        now = counters_once_grown(daemon, before)
        assert (
            now["hit_blocks"] - before["hit_blocks"] >= 8
        )  # the shared prefix (once: vLLM caches it)
        assert now["loaded_blocks"] - before["loaded_blocks"] >= 8
        assert loaded_bytes(restarted, 8 * PAGE_BYTES) >= 8 * PAGE_BYTES
    finally:
        restarted.stop()


def test_the_comparison_fails_when_the_pages_kvd_loads_are_zeroed(
    model: str, reference: list[Output], daemon: DaemonProcess
) -> None:
    """The check on every comparison above: the same engine, its worker's loads zeroed
    after the copy (the harness's `corrupt_loads`), must move the logprobs well past
    the tolerance, or "the same outputs as vLLM alone" would prove only that a copy ran."""
    engine = start_engine(model, {**kvd_config(daemon), "kvd_pool": "zeroed"}, corrupt_loads=True)
    try:
        same_outputs(engine.outputs(PROMPTS), reference)  # all computed: nothing loaded yet
        deadline = time.monotonic() + 15
        while pool_info(daemon, "zeroed").blocks_ready < 8:  # stores land after the step
            assert time.monotonic() < deadline, "the prefix never reached kvd"
            time.sleep(0.1)
        engine.reset_prefix_cache()
        zeroed = engine.outputs(PROMPTS)  # the shared prefix loaded from kvd, then zeroed
        assert loaded_bytes(engine, 8 * PAGE_BYTES) >= 8 * PAGE_BYTES
        assert differences(zeroed, reference), "zeroed pages gave vLLM's own outputs"
        assert largest_difference(zeroed, reference) > 5 * LOGPROB_TOLERANCE
    finally:
        engine.stop()


def test_daemon_down_at_start_then_killed_mid_run(
    model: str, reference: list[Output], tmp_path: Path
) -> None:
    d = DaemonProcess(lease_ms="3000", max_total_bytes="1GiB")  # not started yet
    engine = start_engine(model, {"kvd_endpoint": d.endpoint, "kvd_capacity_bytes": 64 << 20})
    try:
        same_outputs(engine.outputs(PROMPTS), reference)  # no daemon: lookups miss
        d.start()
        deadline = time.monotonic() + 30
        while counters(d).get("blocks_stored", 0) == 0:  # the plug-in reconnects by itself
            assert time.monotonic() < deadline, "the plug-in never reconnected"
            engine.reset_prefix_cache()
            same_outputs(engine.outputs(PROMPTS), reference)
        assert d.proc is not None
        d.kill(signal.SIGKILL)
        t0 = time.monotonic()
        engine.reset_prefix_cache()
        same_outputs(engine.outputs(PROMPTS), reference)  # daemon gone mid-run
        assert time.monotonic() - t0 < 60
        d.start()
        engine.reset_prefix_cache()
        same_outputs(engine.outputs(PROMPTS), reference)
    finally:
        engine.stop()
        d.stop()


def test_tensor_parallel_two_ranks_share_one_sharded_pool(
    daemon: DaemonProcess, model: str
) -> None:
    """TP=2 through vLLM's multiprocessing executor on the CPU platform."""
    plain = start_engine(model, None, tp=2)
    try:
        reference = plain.outputs(PROMPTS)
    finally:
        plain.stop()
    engine = start_engine(model, {**kvd_config(daemon), "kvd_pool": "tp2"}, tp=2)
    try:
        same_outputs(engine.outputs(PROMPTS), reference)
        engine.reset_prefix_cache()
        before = counters(daemon)
        same_outputs(engine.outputs(PROMPTS), reference)
        assert (
            counters_once_grown(daemon, before, ("hit_blocks",))["hit_blocks"]
            - before["hit_blocks"]
            >= 8
        )  # the shared prefix (once: vLLM caches it)
        info = pool_info(daemon, "tp2")
        assert info.layout.world_size == 2 and not info.layout.replicated
        assert info.blocks_ready >= 8
    finally:
        engine.stop()


def test_the_openai_server_with_the_readme_command(daemon: DaemonProcess, model: str) -> None:
    """`python -m vllm.entrypoints.openai.api_server` as the README says, one completion."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--skip-tokenizer-init", "--gpu-memory-utilization", "0.1",
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


def test_mla_under_tp2_stores_one_replicated_copy(
    daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A tiny DeepSeek-V2 (MLA): vLLM's replicated layout, so one copy in a replicated pool."""
    model = write_model(tmp_path_factory.mktemp("tiny-deepseek"), TINY_DEEPSEEK)

    def one_by_one(engine: EngineProcess) -> list[Output]:
        # vLLM's CPU MLA at TP=2 is not batch-invariant: the same batch of three gave
        # other greedy tokens from one run to the next without any connector, while
        # one prompt at a time gives the same logprobs every time.
        return [engine.outputs([prompt])[0] for prompt in PROMPTS]

    plain = start_engine(model, None, tp=2)
    try:
        reference = one_by_one(plain)
    finally:
        plain.stop()
    engine = start_engine(model, {**kvd_config(daemon), "kvd_pool": "mla"}, tp=2)
    try:
        # This model's next-token distribution is flat (top logprobs about -3.5 to
        # -4.8 of 1,024 ids), and MLA's bf16 paths differ by up to 0.13 in a logprob
        # between two engines without any load from kvd (measured at TP=1: a fresh
        # engine with the connector against one without): near-ties go either way.
        for reset in (False, True):  # computed, then loaded from kvd
            if reset:
                engine.reset_prefix_cache()
            found = differences(one_by_one(engine), reference, MLA_TOLERANCE, ties=True)
            assert not found, "\n".join(found[:20])
        assert loaded_bytes(engine, 1) > 0
        info = pool_info(daemon, "mla")
        assert info.layout.world_size == 2 and info.layout.replicated
        assert info.blocks_ready >= 8
    finally:
        engine.stop()


@pytest.mark.skipif(not redis_available(), reason="redis-server is not installed")
def test_a_prefix_computed_on_one_host_is_served_on_another_through_redis(
    model: str, reference: list[Output]
) -> None:
    """Two daemons on one Redis stand for two hosts: vLLM on host B loads what
    vLLM on host A computed, through kvd's remote tier (first RETRY, then hits)."""
    with RedisServer() as store:
        hosts = [DaemonProcess(lease_ms="3000", max_total_bytes="1GiB",
                               remote_url=store.url).start() for _ in range(2)]  # fmt: skip
        try:
            a, b = hosts
            first = start_engine(model, kvd_config(a))
            try:
                same_outputs(first.outputs(PROMPTS), reference)
            finally:
                first.stop()
            deadline = time.monotonic() + 15
            while counters(a).get("remote.blocks_written", 0) < 8:
                assert time.monotonic() < deadline, "the write-behind did not write the prefix"
                time.sleep(0.1)
            second = start_engine(model, kvd_config(b))
            try:
                same_outputs(second.outputs(PROMPTS), reference)
                got = counters_once_grown(b, {}, ("remote.hits", "loaded_blocks"))
                assert got["remote.hits"] >= 8 and got["loaded_blocks"] >= 8
                assert got.get("remote.bad_values", 0) == 0
                assert loaded_bytes(second, 8 * PAGE_BYTES) >= 8 * PAGE_BYTES
            finally:
                second.stop()
        finally:
            for d in hosts:
                d.stop()
