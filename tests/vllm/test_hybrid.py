"""Runs in the test process: hybrid models (several KV cache groups) in real vLLM 0.32 (CPU build) on kvd.

The model is a tiny Gemma 3 (`TINY_GEMMA3`: 3 sliding-window layers of window
128 and 1 full-attention layer, seeded weights), for which vLLM makes 4 KV
cache groups: 3 sliding-window, 1 full. The prompts (640 tokens, a
512-token shared prefix) are five windows long, so the sliding-window
lookups (the last full window, scanning back) and stores (only what a load
can reach) decide what is served. The reference is the same engine without
a connector. Engines, one at a time: the reference; `first` on kvd (stores,
then hits after vLLM's own cache is reset); `second`, a new process on the
same pool (served from kvd; a load kvd cannot serve; a prompt of 16
windows); one with offload blocks of two device blocks (`block_size` 64)
whose lookups are round trips (no ready table); a tiny gpt-oss.

Not tested here: a Mamba hybrid (a tiny Jamba, dummy weights) does not run
on vLLM 0.32's CPU build: its worker fails at start ("Dimension out of
range"), without kvd.
"""

from __future__ import annotations

import signal
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.driver import EngineProcess, Output, differences
from kvd_tools.vllm_harness.engine import TINY_GEMMA3, TINY_GPT_OSS, write_model

with warnings.catch_warnings():
    # vLLM's config imports torch modules that warn about their own deprecations
    # (torch.jit) while importing; `make check` turns warnings into errors.
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

PREFIX = [(i * 37) % 1000 + 3 for i in range(512)]
PROMPTS = [PREFIX + [(i * 13 + j * 101) % 1000 + 3 for i in range(128)] for j in range(2)]
# Stored by `first`, never seen by `second` before its load fails.
OTHER = [[(i * 29 + j * 7 + 500) % 1000 + 3 for i in range(640)] for j in range(2)]
CHUNKS = 640 // 32  # device blocks (and kvd blocks, one a chunk) of one prompt, per group
LONG = [(i * 53 + 11) % 1000 + 3 for i in range(2048)]  # 16 windows
LONG_CHUNKS = 2048 // 32
WINDOW_CHUNKS = TINY_GEMMA3["sliding_window"] // 32
WAIT_S = 15.0  # vLLM's figures and kvd's events come a little after the request
LOG_CHARS = 10**8  # an engine's whole log


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


def figure(engine: EngineProcess, name: str, above: float) -> float:
    """vLLM's metric `name` once it is above `above`, or its value after `WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while (value := float(engine.metrics().get(name, 0.0))) <= above:
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return value


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model(Path(tmp_path_factory.mktemp("tiny-gemma3")), TINY_GEMMA3)


@pytest.fixture(scope="module")
def reference(model: str) -> dict[str, list[Output]]:
    """vLLM without a connector: the outputs of each prompt set, each run alone."""
    engine = start(model, None)
    try:
        return {
            "prompts": engine.outputs(PROMPTS),
            "other": engine.outputs(OTHER),
            "long": engine.outputs([LONG]),
        }
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


@pytest.fixture(scope="module")
def first(
    model: str, reference: dict[str, list[Output]], daemon: DaemonProcess
) -> Iterator[EngineProcess]:
    """An engine on kvd that has run (and stored) PROMPTS and OTHER."""
    engine = start(model, kvd_config(daemon))
    try:
        assert "kvd offloading off" not in engine.log_tail(200_000)
        same_outputs(engine.outputs(PROMPTS), reference["prompts"])  # stores
        same_outputs(engine.outputs(OTHER), reference["other"])
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def second(model: str, first: EngineProcess, daemon: DaemonProcess) -> Iterator[EngineProcess]:
    """A new engine process on `first`'s pool (`first` stopped: one engine at a time)."""
    first.stop()
    engine = start(model, kvd_config(daemon))
    try:
        yield engine
    finally:
        engine.stop()


def test_a_gemma3_engine_is_served_with_the_same_tokens_and_hits(
    first: EngineProcess, reference: dict[str, list[Output]]
) -> None:
    assert external_hits(first) == 0
    first.reset_prefix_cache()  # vLLM's own cache is empty now: kvd serves
    same_outputs(first.outputs(PROMPTS), reference["prompts"])
    hits = external_hits(first)
    # Each prompt but its last block (vLLM recomputes the last token): every
    # group found its blocks, the sliding ones their last window.
    assert hits >= 2 * (CHUNKS - 1) * 32, hits
    assert loaded(first) > 0
    assert first.metrics().get("vllm:kv_offload_kvd_unservable_loads", 0) == 0


def test_a_new_engine_process_is_served_from_the_pool(
    second: EngineProcess, reference: dict[str, list[Output]]
) -> None:
    same_outputs(second.outputs(PROMPTS), reference["prompts"])  # its first requests
    assert external_hits(second) >= 2 * (CHUNKS - 1) * 32


def test_a_load_kvd_cannot_serve_is_recomputed_per_request(
    second: EngineProcess, reference: dict[str, list[Output]], daemon: DaemonProcess
) -> None:
    """OTHER is in the pool (`first` stored it) and in none of this process's device
    blocks. The daemon stopped (SIGSTOP) just before: the lookup is answered from
    the ready table (shared memory, no message), the pin at `prepare_load` gets no
    answer within the client's timeout (500 ms), so the load's spec is unservable; the worker
    reports the load failed and kvd's connector names its request in vLLM's
    `failed_recving` (vLLM refuses block-level reports from engines of several
    groups). vLLM recomputes the request: the same tokens and logprobs, nothing
    loaded, no exception, no hang. Then, the daemon back, kvd serves OTHER again."""
    unservable = figure(second, "vllm:kv_offload_kvd_unservable_loads", -1)
    loaded_before = loaded(second)
    logged = len(second.log_tail(LOG_CHARS))
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = second.outputs(OTHER, timeout=120)
        seconds = time.monotonic() - t0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    same_outputs(got, reference["other"])  # recomputed, not read from unwritten blocks
    assert seconds < 60, seconds
    assert figure(second, "vllm:kv_offload_kvd_unservable_loads", unservable) > unservable
    assert loaded(second) == loaded_before
    assert "Traceback" not in second.log_tail(LOG_CHARS)[logged:]  # none since the stop
    # The daemon answers again: the plug-in reconnects, and kvd serves OTHER.
    deadline = time.monotonic() + 30
    hits = external_hits(second)
    while external_hits(second) == hits:
        assert time.monotonic() < deadline, "kvd never served OTHER after the daemon came back"
        second.reset_prefix_cache()
        same_outputs(second.outputs(OTHER), reference["other"])
        time.sleep(0.5)


def replayed_stores(daemon: DaemonProcess) -> Counter[int]:
    """Blocks stored per `group_idx` in every BlockStored the daemon still holds for
    replay (its replay socket, as vLLM's `ZmqEventPublisher` answers one)."""
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    counts: Counter[int] = Counter()
    try:
        sock.connect(f"ipc://{daemon.runtime_dir}/replay.sock")
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert sock.poll(5000), "the replay socket did not answer"
            _, _, seq, payload = sock.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                return counts
            for event in decode(payload).events:
                if isinstance(event, BlockStored):
                    assert event.group_idx is not None
                    counts[event.group_idx] += len(event.block_hashes)
    finally:
        sock.close()
        ctx.destroy(linger=0)


def pool_groups(daemon: DaemonProcess) -> tuple[p.Group, ...]:
    """The groups of the daemon's one pool (the only layout the engines so far had)."""
    conn = Connection(daemon.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        reply = conn.call(p.Pools)
        assert isinstance(reply, p.PoolsResult)
        (pool,) = reply.pools
        return pool.layout.groups
    finally:
        conn.close()


def test_sliding_window_stores_skip_chunks_outside_the_window(
    second: EngineProcess, reference: dict[str, list[Output]], daemon: DaemonProcess
) -> None:
    """A prompt of 16 windows: the full-attention group stores every chunk, each
    sliding-window group only the chunks a load can reach (its last window), as
    vLLM's own offloading does (`_reachable_store_block_mask`). Counted from the
    daemon's events, per group. After `reset_prefix_cache()` each sliding group's
    lookup (scanning back) finds that last window, so the whole prompt but its last
    chunk comes from kvd."""
    groups = pool_groups(daemon)
    full = [i for i, g in enumerate(groups) if g.kind == "full_attention"]
    sliding = [i for i, g in enumerate(groups) if g.kind == "sliding_window"]
    assert len(full) == 1 and len(sliding) == 3, groups
    before = replayed_stores(daemon)
    same_outputs(second.outputs([LONG]), reference["long"])
    deadline = time.monotonic() + WAIT_S
    while (stored := replayed_stores(daemon) - before)[full[0]] < LONG_CHUNKS:
        assert time.monotonic() < deadline, f"stores per group: {stored}"
        time.sleep(0.25)
    time.sleep(1.0)  # a later event of the same request would come by now
    stored = replayed_stores(daemon) - before
    assert stored[full[0]] == LONG_CHUNKS, stored
    for g in sliding:  # the last window (one more chunk where the last is partial)
        assert WINDOW_CHUNKS <= stored[g] <= WINDOW_CHUNKS + 1, stored
    hits = external_hits(second)
    second.reset_prefix_cache()
    same_outputs(second.outputs([LONG]), reference["long"])
    assert external_hits(second) - hits >= (LONG_CHUNKS - 1) * 32


def test_offload_blocks_of_two_device_blocks_are_served_over_round_trips(
    model: str, reference: dict[str, list[Output]], daemon: DaemonProcess
) -> None:
    """vLLM's `block_size` extra key at twice the device block: a kvd block is a
    chunk of two device blocks, of every group (another pool: another layout).
    Without the ready table every lookup is a round trip (one a group)."""
    engine = start(model, kvd_config(daemon, block_size=64, kvd_ready_table=False))
    try:
        same_outputs(engine.outputs(PROMPTS), reference["prompts"])
        engine.reset_prefix_cache()
        same_outputs(engine.outputs(PROMPTS), reference["prompts"])
        assert external_hits(engine) >= 2 * (CHUNKS - 2) * 32
        figures = engine.metrics()
        assert figures.get("vllm:kv_offload_kvd_lookup_rpcs", 0) > 0
    finally:
        engine.stop()


def test_a_gpt_oss_engine_is_served(
    tmp_path_factory: pytest.TempPathFactory, daemon: DaemonProcess
) -> None:
    """A tiny gpt-oss (`TINY_GPT_OSS`: sliding-window and full-attention layers
    alternating, attention sinks, biases, 4 experts; seeded weights), 2 KV cache
    groups. The reference is this engine's own first run: its pool (another
    layout, another pool) is empty then, so vLLM computes every token, as without
    a connector (one engine start, not two). Then, vLLM's own cache reset, the
    prompts come from kvd with the same tokens and top logprobs."""
    model = write_model(Path(tmp_path_factory.mktemp("tiny-gpt-oss")), TINY_GPT_OSS)
    engine = start(model, kvd_config(daemon))
    try:
        assert "kvd offloading off" not in engine.log_tail(LOG_CHARS)
        computed = engine.outputs(OTHER)
        assert external_hits(engine) == 0  # nothing from kvd: the reference
        deadline, hits = time.monotonic() + 30, 0.0
        while hits < 2 * (CHUNKS - 1) * 32:  # both prompts' stores landed (after the step)
            assert time.monotonic() < deadline, f"hits: {hits}"
            before = external_hits(engine)
            engine.reset_prefix_cache()
            same_outputs(engine.outputs(OTHER), computed)
            hits = external_hits(engine) - before
    finally:
        engine.stop()
