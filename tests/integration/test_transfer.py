"""Runs in the test process: transfer jobs end to end with real worker processes (issue 4)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvd_client import Layout, Scheduler
from kvd_client import protocol as p
from kvd_tools.launcher import DaemonProcess
from tests.integration.engine_harness import CacheSpec, Rank, all_ranks

NUM_BLOCKS = 6


@pytest.fixture(scope="module")
def big_daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(max_total_bytes="2GiB", job_timeout_ms="20000")
    d.start()
    try:
        yield d
    finally:
        d.stop()


# Worker environments: the backend's defaults (these small jobs take torch
# copies), and every job through the native copier where it was built.
COPIERS = {"default": {}, "native": {"KVD_NATIVE_MIN_BYTES": "0"}}


@pytest.fixture(scope="module")
def engines(big_daemon: DaemonProcess) -> Iterator[dict[tuple[int, str], list[Rank]]]:
    groups = {
        (tp, copier): [Rank(r, tp, big_daemon.endpoint, env) for r in range(tp)]
        for tp in (1, 2, 4)
        for copier, env in COPIERS.items()
    }
    try:
        yield groups
    finally:
        for ranks in groups.values():
            for rank in ranks:
                rank.kill()


def wait_result(s: Scheduler, job_id: int, timeout: float = 20) -> p.JobResult:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in s.finished():
            if r.job_id == job_id:
                return r
        time.sleep(0.01)
    raise TimeoutError(f"job {job_id} did not finish")


def drop(d: DaemonProcess, pool: str) -> None:
    d.drop_pool(pool)


@pytest.mark.parametrize("slot_bytes", [16 << 10, 2 << 20])
@pytest.mark.parametrize("cache_layout", ["contiguous", "per_layer"])
@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("copier", list(COPIERS))
def test_round_trip_bit_exact(
    big_daemon: DaemonProcess,
    engines: dict[tuple[int, str], list[Rank]],
    copier: str,
    tp: int,
    replicated: bool,
    cache_layout: str,
    slot_bytes: int,
) -> None:
    ranks = engines[tp, copier]
    if copier == "native":
        from kvd_client.backends.native import available

        if not available():
            pytest.skip("the native copier is not built")
        assert all_ranks(ranks, "native_min_bytes") == [0] * tp  # every job goes native
    pool = f"rt-{copier}-{tp}-{int(replicated)}-{cache_layout}-{slot_bytes}"
    layout_args = (f"model-{pool}", "bfloat16", 16, tp, replicated, slot_bytes, cache_layout)
    spec = CacheSpec(cache_layout, slot_bytes, 2 * NUM_BLOCKS)
    # Twice the blocks stored: a session may pin at most half a pool.
    capacity = 2 * NUM_BLOCKS * slot_bytes * (1 if replicated else tp)
    with Scheduler(
        pool,
        Layout(*layout_args),
        engine_id=f"model-{pool}-engine",
        endpoint=big_daemon.endpoint,
        capacity_bytes=capacity,
    ) as s:
        all_ranks(ranks, "open", (pool, layout_args, spec))
        all_ranks(ranks, "fill", 7)
        src = list(range(NUM_BLOCKS))
        before = all_ranks(ranks, "digest", src)
        keys = [f"{pool}/{i}".encode()[:64] for i in range(NUM_BLOCKS)]
        ticket = s.store(keys, src)
        assert ticket is not None and ticket.job_id is not None
        assert ticket.keys_to_store == keys
        assert all_ranks(ranks, "wait", [ticket.job_id]) == [{ticket.job_id: True}] * tp
        stored = wait_result(s, ticket.job_id)
        assert stored.ok
        moved = all_ranks(ranks, "bytes")
        if replicated:  # rank 0 alone writes the one shared copy
            assert moved == [NUM_BLOCKS * slot_bytes] + [0] * (tp - 1)
            assert stored.nbytes == NUM_BLOCKS * slot_bytes
        else:
            assert moved == [NUM_BLOCKS * slot_bytes] * tp
        assert s.lookup(keys) == NUM_BLOCKS

        all_ranks(ranks, "zero")
        dst = [NUM_BLOCKS + i for i in reversed(range(NUM_BLOCKS))]  # scattered on purpose
        job = s.load(keys, dst)
        assert all_ranks(ranks, "wait", [job]) == [{job: True}] * tp
        loaded = wait_result(s, job)
        assert loaded.ok
        after = all_ranks(ranks, "digest", dst)
        for rank in range(tp):
            expected = before[0] if replicated else before[rank]  # every rank reads slot 0
            assert after[rank] == expected, f"rank {rank} differs"
        info = s.stats().pools
        (mine,) = [pi for pi in info if pi.name == pool]
        assert mine.blocks_pinned == 0 and mine.blocks_in_flight == 0
    drop(big_daemon, pool)


def test_workers_missing(big_daemon: DaemonProcess) -> None:
    layout = Layout("lonely", "bfloat16", 16, 2, False, 4096)
    with Scheduler(
        "lonely", layout, engine_id="nobody", endpoint=big_daemon.endpoint, capacity_bytes=1 << 20
    ) as s:
        with pytest.raises(Exception) as err:
            s.load([b"k"], [0])
        assert getattr(err.value, "code", None) == "WORKERS_MISSING"
        with pytest.raises(Exception) as err:
            s.store([b"k"], [0])
        assert getattr(err.value, "code", None) == "WORKERS_MISSING"
        assert s.lookup([b"k"]) == 0
    drop(big_daemon, "lonely")


def _pool_info(s: Scheduler, pool: str) -> p.PoolInfo:
    (info,) = [pi for pi in s.stats().pools if pi.name == pool]
    return info


@pytest.mark.parametrize("kind", ["store", "load"])
def test_worker_killed_mid_job(big_daemon: DaemonProcess, kind: str) -> None:
    pool = f"kill-{kind}"
    layout_args = (f"model-{pool}", "bfloat16", 16, 2, False, 16 << 10, "contiguous")
    spec = CacheSpec("contiguous", 16 << 10, 2 * NUM_BLOCKS)
    ranks = [Rank(r, 2, big_daemon.endpoint) for r in range(2)]
    try:
        with Scheduler(
            pool,
            Layout(*layout_args),
            engine_id=f"model-{pool}-engine",
            endpoint=big_daemon.endpoint,
            capacity_bytes=4 << 20,
        ) as s:
            all_ranks(ranks, "open", (pool, layout_args, spec))
            all_ranks(ranks, "fill", 3)
            keys = [f"{pool}/{i}".encode() for i in range(NUM_BLOCKS)]
            src = list(range(NUM_BLOCKS))
            if kind == "load":
                ticket = s.store(keys, src)
                assert ticket is not None and ticket.job_id is not None
                assert all_ranks(ranks, "wait", [ticket.job_id]) == [{ticket.job_id: True}] * 2
                assert wait_result(s, ticket.job_id).ok
                job_id = s.load(keys, [NUM_BLOCKS + i for i in src])
                assert _pool_info(s, pool).blocks_pinned == NUM_BLOCKS
            else:
                ticket = s.store(keys, src)
                assert ticket is not None and ticket.job_id is not None
                job_id = ticket.job_id
            # Rank 0 finishes its part; rank 1 dies before it acknowledges.
            assert ranks[0].call("wait", [job_id]) == {job_id: True}
            ranks[1].kill()
            deadline = time.monotonic() + 4 * big_daemon.lease_s + 2
            result = None
            while result is None and time.monotonic() < deadline:
                if kind == "store":  # never a hit on a block that was not fully stored
                    assert s.lookup(keys) in (None, 0)
                result = next((r for r in s.finished() if r.job_id == job_id), None)
                time.sleep(0.02)
            assert result is not None and not result.ok
            assert "rank 1" in result.detail
            # Rank 1's process might only be stalled: its slots are held one more
            # lease past its expiry, and until the job's deadline (it could still
            # start it until then), then given back.
            deadline = time.monotonic() + int(big_daemon.flags["job-timeout-ms"]) / 1000 + 2
            info = _pool_info(s, pool)
            while (info.blocks_pinned, info.blocks_in_flight) != (0, 0):
                assert time.monotonic() < deadline, info
                if kind == "store":
                    assert s.lookup(keys) in (None, 0)
                time.sleep(0.02)
                info = _pool_info(s, pool)
            if kind == "store":
                assert s.lookup(keys) == 0
                assert info.blocks_free == info.num_blocks
            else:
                assert s.lookup(keys) == NUM_BLOCKS  # the stored copy is intact
            assert s.check_invariants() == []
    finally:
        for rank in ranks:
            rank.kill()
    drop(big_daemon, pool)
