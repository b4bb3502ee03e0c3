"""Runs in the test process: hybrid models (several KV cache groups) in real vLLM 0.32 (CPU build) on kvd.

The model is a tiny Gemma 3 (`TINY_GEMMA3`: 3 sliding-window layers of window
128 and 1 full-attention layer, seeded weights), for which vLLM makes 4 KV
cache groups: 3 sliding-window, 1 full. The prompts (640 tokens, a
512-token shared prefix) are five windows long, so the sliding-window
lookups (the last full window, scanning back) and stores (only what a load
can reach) decide what is served. The reference is the same engine without
a connector. Engines: the reference, one on kvd (stores, then hits after
vLLM's own cache is reset), a new process on the same pool (served from
kvd), one with offload blocks of two device blocks (`block_size` 64).

Not tested here yet: a gpt-oss style model (sliding + full attention, MoE)
starts and generates on vLLM 0.32's CPU build with dummy weights, but the
harness writes no gpt-oss weights (`weight_shapes`), and dummy weights leave
the tokens blind to the KV; a Mamba hybrid (a tiny Jamba, dummy weights)
does not run on the CPU build: its worker fails at start ("Dimension out of
range"), without kvd.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.driver import EngineProcess, Output, differences
from kvd_tools.vllm_harness.engine import TINY_GEMMA3, write_model

PREFIX = [(i * 37) % 1000 + 3 for i in range(512)]
PROMPTS = [PREFIX + [(i * 13 + j * 101) % 1000 + 3 for i in range(128)] for j in range(2)]
CHUNKS = 640 // 32  # device blocks (and kvd blocks, one a chunk) of one prompt, per group


def start(model: str, kvd: dict[str, Any] | None) -> EngineProcess:
    return EngineProcess({"model": model, "kvd": kvd})


def same_outputs(got: list[Output], want: list[Output]) -> None:
    found = differences(got, want)
    assert not found, "\n".join(found[:20])


def external_hits(engine: EngineProcess) -> float:
    """Tokens vLLM took from the connector (`vllm:external_prefix_cache_hits`)."""
    reply = engine.ask({"metrics": True, "prefixes": ["vllm:external_prefix_cache_hits"]})
    return float(sum(reply["metrics"].values()))


def loaded(engine: EngineProcess) -> float:
    return float(engine.metrics().get("vllm:kv_offload_load_bytes", 0.0))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(Path(tmp_path_factory.mktemp("tiny-gemma3")), TINY_GEMMA3)


@pytest.fixture(scope="module")
def reference(model: str) -> Iterator[list[Output]]:
    """vLLM without a connector: the outputs, and the engine's time to a first token
    of a prompt it has not seen (for the TTFT figure)."""
    engine = start(model, None)
    try:
        yield engine.outputs(PROMPTS)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(lease_ms="3000", max_total_bytes="1GiB").start()
    try:
        yield d
    finally:
        d.stop()


def kvd_config(daemon: DaemonProcess, **extra: Any) -> dict[str, Any]:
    return {"kvd_endpoint": daemon.endpoint, "kvd_capacity_bytes": 64 << 20, **extra}


def test_a_gemma3_engine_is_served_with_the_same_tokens_and_hits(
    model: str, reference: list[Output], daemon: DaemonProcess
) -> None:
    engine = start(model, kvd_config(daemon))
    try:
        log = engine.log_tail(200_000)
        assert "kvd offloading off" not in log
        same_outputs(engine.outputs(PROMPTS), reference)  # stores
        assert external_hits(engine) == 0
        engine.reset_prefix_cache()  # vLLM's own cache is empty now: kvd serves
        same_outputs(engine.outputs(PROMPTS), reference)
        hits = external_hits(engine)
        # Each prompt but its last block (vLLM recomputes the last token): every
        # group found its blocks, the sliding ones their last window.
        assert hits >= 2 * (CHUNKS - 1) * 32, hits
        assert loaded(engine) > 0
        figures = engine.metrics()
        assert figures.get("vllm:kv_offload_kvd_unservable_loads", 0) == 0
    finally:
        engine.stop()
    # A new engine process on the same pool: its first requests come from kvd.
    again = start(model, kvd_config(daemon))
    try:
        same_outputs(again.outputs(PROMPTS), reference)
        assert external_hits(again) >= 2 * (CHUNKS - 1) * 32
    finally:
        again.stop()


def test_offload_blocks_of_two_device_blocks_are_served(
    model: str, reference: list[Output], daemon: DaemonProcess
) -> None:
    """vLLM's `block_size` extra key at twice the device block: a kvd block is a
    chunk of two device blocks, of every group (another pool: another layout)."""
    engine = start(model, kvd_config(daemon, block_size=64))
    try:
        same_outputs(engine.outputs(PROMPTS), reference)
        engine.reset_prefix_cache()
        same_outputs(engine.outputs(PROMPTS), reference)
        assert external_hits(engine) >= 2 * (CHUNKS - 2) * 32
    finally:
        engine.stop()
