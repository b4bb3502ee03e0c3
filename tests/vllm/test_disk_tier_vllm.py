"""Runs in the test process: real vLLM 0.32 (CPU build) served from kvd's disk tier (issue 27).

A daemon whose pool holds RAM_BLOCKS blocks in RAM over a slab of several
times more (SPEC 16), LRU so that what leaves RAM first is known: one engine
with kvd's connector runs prompt A, then FILLERS (other prompts, no shared
prefix) until A's blocks have left the RAM pool and are on the disk alone.
vLLM's own cache is reset and A runs again: its blocks must come from the
disk (the daemon's `disk.hits` grows by A's blocks, vLLM's connector loads
their bytes) and give the tokens and top logprobs of the first run and of vLLM
without a connector (`same_outputs`, which fails on zeroed pages: see
test_plugin). Then the host "reboots": the daemon stops (SIGTERM, as at a
shutdown; then SIGKILL, a crash), its shared-memory segments are unlinked as a
reboot wipes /dev/shm, and it starts again on the same runtime dir and
disk_dir; the same engine (its plug-in reconnects by itself) runs A once more:
served from the adopted slab, the same tokens.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import posix_ipc
import pytest

from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.driver import EngineProcess, Output
from tests.vllm.test_plugin import (
    PAGE_BYTES,
    counters,
    loaded_bytes,
    pool_info,
    same_outputs,
    start_engine,
)

POOL = "disk-vllm"
RAM_BLOCKS = 64  # the pool's RAM: 2 MiB of the tiny Llama's 32 KiB blocks
MAX_TOTAL = 64 << 20
# The pool's share of disk_bytes is disk_bytes * its RAM / max_total_bytes: 8x its RAM
# (512 rows), with room for the slab's header and entry table.
DISK_BYTES = 8 * MAX_TOTAL + (8 << 20)
A_BLOCKS = 10  # full 32-token blocks of A (vLLM stores and looks up only those)
LENGTH = A_BLOCKS * 32 + 10
A = [(i * 37 + 5) % 1000 + 3 for i in range(LENGTH)]
# Each filler shares no block with A or another filler (their first tokens differ);
# 10 x 10 blocks push A's 10 out of a RAM pool of 64 under LRU.
FILLERS = [[(i * 13 + j * 101 + 7) % 997 + 3 for i in range(LENGTH)] for j in range(10)]


def wait_for(
    what: str, check: Callable[[], bool], seconds: float = 20.0, d: DaemonProcess | None = None
) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {counters(d) if d is not None else ''}")
        time.sleep(0.1)


def grown(d: DaemonProcess, name: str, before: dict[str, int], by: int) -> int:
    """How much the daemon's counter `name` grew past `before`, once it grew by `by`
    or after 15 s (the disk's reads settle on the daemon's loop after the lookup)."""
    deadline = time.monotonic() + 15
    while True:
        now = counters(d).get(name, 0) - before.get(name, 0)
        if now >= by or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def written(d: DaemonProcess, blocks: int) -> bool:
    return counters(d).get("disk.blocks_written", 0) >= blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvd_tools.vllm_harness.engine import write_model

    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(model: str) -> list[Output]:
    """A's tokens and top logprobs from vLLM without any connector."""
    engine = start_engine(model, None)
    try:
        return engine.outputs([A])
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    # A directory on a real disk (/tmp is ext4 here and in CI), removed after.
    with tempfile.TemporaryDirectory(prefix="kvd-disk-") as disk_dir:
        d = DaemonProcess(
            lease_ms="3000",
            policy="lru",
            max_total_bytes=str(MAX_TOTAL),
            disk_dir=disk_dir,
            disk_bytes=str(DISK_BYTES),
            disk_timeout_ms="2000",
        )
        try:
            d.start()
            yield d
        finally:
            d.stop()


@pytest.fixture(scope="module")
def engine(model: str, reference: list[Output], daemon: DaemonProcess) -> Iterator[EngineProcess]:
    """One engine with kvd's connector for the whole file (one takes 25 to 60 s to
    start); after the reference engine stopped, since this machine has 2 cores."""
    kvd = {"kvd_endpoint": daemon.endpoint, "kvd_pool": POOL,
           "kvd_capacity_bytes": RAM_BLOCKS * PAGE_BYTES}  # fmt: skip
    e = start_engine(model, kvd)
    try:
        yield e
    finally:
        e.stop()


@pytest.fixture(scope="module")
def a_on_disk(
    engine: EngineProcess, daemon: DaemonProcess, reference: list[Output]
) -> list[Output]:
    """A run once (its blocks stored to kvd, then written behind to the slab), then
    pushed out of the RAM pool by the fillers; A's first outputs."""
    first = engine.outputs([A])
    same_outputs(first, reference)
    wait_for("A's blocks never reached the disk",
             lambda: counters(daemon).get("disk.blocks_written", 0) >= A_BLOCKS)  # fmt: skip
    # Two fillers at a time, each batch written behind before the next: a burst
    # larger than the pool would be stored and written in part (the write-behind
    # pins at most half the pool and skips the rest, by design).
    for n in range(0, len(FILLERS), 2):
        engine.outputs(FILLERS[n : n + 2], max_tokens=1)
        wait_for("the fillers' blocks never reached the disk",
                 functools.partial(written, daemon, A_BLOCKS * (n + 3)), d=daemon)  # fmt: skip
    stored = len(FILLERS) * A_BLOCKS
    wait_for("the disk index does not hold every block",
             lambda: counters(daemon).get("disk.blocks", 0) >= A_BLOCKS + stored, d=daemon)  # fmt: skip
    c = counters(daemon)
    assert c.get("blocks_stored", 0) >= A_BLOCKS + stored
    # Under LRU A's blocks, stored first, went first: more went than A's.
    assert c.get("evictions", 0) >= A_BLOCKS + stored - RAM_BLOCKS
    info = pool_info(daemon, POOL)
    assert info.num_blocks == RAM_BLOCKS
    assert c.get("disk.errors", 0) == 0
    return first


def served_from_disk(
    engine: EngineProcess, daemon: DaemonProcess, first: list[Output], reference: list[Output]
) -> None:
    """vLLM's own cache reset, A again: its blocks read from the disk, loaded into
    vLLM, and the same tokens as before and as vLLM alone."""
    engine.reset_prefix_cache()  # vLLM's own cache must not serve A
    before = counters(daemon)
    figures = engine.metrics()
    loaded = loaded_bytes(engine)
    again = engine.outputs([A])
    hits = grown(daemon, "disk.hits", before, A_BLOCKS)
    after = counters(daemon)
    assert hits >= A_BLOCKS, f"A not served from disk: {before} -> {after}"
    for bad in ("disk.bad_rows", "disk.errors", "disk.timeouts", "disk.fetch_failures"):
        assert after.get(bad, 0) == before.get(bad, 0), bad
    # vLLM's connector loaded A's blocks from kvd: it did not wait past its RETRY
    # bound and recompute them.
    want = loaded + A_BLOCKS * PAGE_BYTES
    assert loaded_bytes(engine, want) >= want
    now = engine.metrics()

    def more(name: str) -> float:
        return now.get(name, 0) - figures.get(name, 0)

    assert more("vllm:kv_offload_kvd_lookup_hit_keys") >= A_BLOCKS
    assert more("vllm:kv_offload_kvd_retries_given_up") == 0
    assert more("vllm:kv_offload_kvd_unservable_loads") == 0
    same_outputs(again, first)
    same_outputs(again, reference)


def test_a_prefix_evicted_from_ram_to_disk_is_served_to_vllm_from_disk(
    engine: EngineProcess,
    daemon: DaemonProcess,
    a_on_disk: list[Output],
    reference: list[Output],
) -> None:
    served_from_disk(engine, daemon, a_on_disk, reference)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["reboot", "crash"])
def test_after_a_reboot_the_adopted_slab_serves_vllm(
    engine: EngineProcess,
    daemon: DaemonProcess,
    a_on_disk: list[Output],
    reference: list[Output],
    stop: signal.Signals,
) -> None:
    """The daemon stopped, /dev/shm wiped (its segments unlinked) and started again
    on the same runtime dir and disk_dir: the RAM pool starts empty, the slab is
    adopted, and the engine's plug-in, reconnected, is served A from it."""
    segments = daemon.segments()
    assert any(name.startswith(f"/kvd.{POOL}.") for name in segments), segments
    daemon.kill(stop)
    for name in segments:  # what a reboot does to /dev/shm
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)
    assert not any(Path("/dev/shm", name.lstrip("/")).exists() for name in segments)
    daemon.start()

    def adopted() -> bool:
        """The plug-in re-attached, its scheduler and its worker both (the worker's
        session alone comes back first after a SIGKILL: a lookup of the scheduler
        meanwhile is a miss), and the pool and its slab are back."""
        with contextlib.suppress(AssertionError, ValueError):
            info = pool_info(daemon, POOL)
            return (
                info.blocks_ready == 0
                and info.sessions >= 2
                and (counters(daemon).get("disk.blocks", 0) >= A_BLOCKS)
            )
        return False

    wait_for("the plug-in never re-attached, or the slab was not adopted", adopted, 60)
    assert "disk_slab_adopted" in daemon.log_path.read_text(errors="replace")
    served_from_disk(engine, daemon, a_on_disk, reference)
