"""Runs in the test process: stores right after a warm start (SPEC 13).

A real daemon, a real scheduler and worker in this process, real shared
memory. The daemon is SIGKILLed while a worker still holds a job it handed
out and started again on the same runtime dir: the slots that job names are
held back (a store job) or kept pinned (a load job) until the dead daemon's
jobs' deadlines passed, and every other slot serves stores at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from kvd_client import Scheduler, Worker
from kvd_tools.harness import block_content, contiguous_cache
from kvd_tools.launcher import DaemonProcess
from tests.integration.test_warm_restart import ELEMS, LAYOUT, key, kill_and_restart, pool_info

JOB_TIMEOUT_MS = 6000  # the dead daemon's jobs are held for two of these: 12 s


def _until(what: str, done: object, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not {what} within {seconds} s"
        time.sleep(0.02)


def _restart(d: DaemonProcess, s: Scheduler, w: Worker) -> None:
    """`kill_and_restart`, then until the new daemon has both clients attached (a
    worker that has not yet noticed the old daemon died still says connected)."""
    kill_and_restart(d, s, w)
    _until("both clients attached", lambda: (i := pool_info(d, "p")) and i.sessions == 2)


def _store(s: Scheduler, w: Worker, k: bytes, device_block: int) -> None:
    """Stores `k` from `device_block` and waits until it is ready."""
    ticket = s.store([k], [device_block])
    assert ticket is not None and ticket.job_id is not None
    assert w.wait([ticket.job_id])[ticket.job_id]
    _until(f"{k.hex()} ready", lambda: s.finished() is not None and s.lookup([k]) == 1)


def _load_equals(s: Scheduler, w: Worker, cache: torch.Tensor, k: bytes, content: int) -> None:
    cache[7].zero_()
    job = s.load([k], [7])
    assert w.wait([job])[job]
    assert torch.equal(cache[7], block_content(content, ELEMS)), f"{k.hex()} holds other bytes"


@contextlib.contextmanager
def two_block_pool(
    lease_ms: int = 3000, job_timeout_ms: int = JOB_TIMEOUT_MS
) -> Iterator[tuple[DaemonProcess, Scheduler, Worker, torch.Tensor]]:
    """A daemon, a pool of 2 blocks, a scheduler and a worker whose device blocks
    0 to 3 hold contents 1 to 4, and key 1 stored from block 0."""
    d = DaemonProcess(lease_ms=str(lease_ms), job_timeout_ms=str(job_timeout_ms)).start()
    cache = contiguous_cache(8, LAYOUT.slot_bytes, "int64")
    try:
        with (
            Scheduler("p", LAYOUT, engine_id="e", endpoint=d.endpoint,
                      capacity_bytes=2 * LAYOUT.slot_bytes) as s,
            Worker(0, 1, cache, pool="p", layout=LAYOUT, engine_id="e", endpoint=d.endpoint) as w,
        ):  # fmt: skip
            for i in range(4):
                cache[i] = block_content(i + 1, ELEMS)
            _store(s, w, key(1), 0)
            yield d, s, w, cache
    finally:
        d.stop()


def test_a_store_job_of_the_dead_daemon_keeps_its_slot_and_other_slots_serve_at_once() -> None:
    """Pool of 2 blocks: A ready in one slot, B's store job pushed to the worker
    (not run yet) into the other. After the restart, C is stored within a second
    of the daemon listening, into A's slot (B's is held), and when the dead
    daemon's job for B is then copied it lands in its own held slot: C keeps
    its bytes. Once the hold passes, the held slot serves stores again."""
    with two_block_pool() as (d, s, w, cache):
        old = s.store([key(2)], [1])
        assert old is not None and old.job_id is not None
        w._conn.receive(2000)
        w._launch()  # the job arrived; the engine has not named it yet
        assert old.job_id in w._arrived

        _restart(d, s, w)
        listening = time.monotonic()
        info = pool_info(d, "p")
        assert info is not None and info.blocks_held == 1 and info.blocks_ready == 1
        while (new := s.store([key(3)], [2])) is None:
            assert time.monotonic() - listening < 1.0, "no store accepted within 1 s"
            time.sleep(0.01)
        assert new.job_id is not None and new.evicted_keys == [key(1)]
        assert w.wait([new.job_id])[new.job_id]
        _until("C ready", lambda: s.finished() is not None and s.lookup([key(3)]) == 1)

        # The dead daemon's job is named now, within its deadline: it copies
        # B's bytes into the slot it names, which the new daemon held back.
        assert w.wait([old.job_id], timeout_s=5)[old.job_id], "the old job did not run"
        _load_equals(s, w, cache, key(3), 3)
        assert pool_info(d, "p").blocks_held == 1  # type: ignore[union-attr]

        _until("the held slot released",
               lambda: pool_info(d, "p").blocks_held == 0, 2.5 * JOB_TIMEOUT_MS / 1000)  # type: ignore[union-attr]  # fmt: skip
        _store(s, w, key(4), 3)  # into the slot B's job named
        _load_equals(s, w, cache, key(4), 4)
        _load_equals(s, w, cache, key(3), 3)


def test_a_block_a_load_job_of_the_dead_daemon_reads_is_not_evicted_until_the_hold_ends() -> None:
    """Pool of 2 blocks, A and B ready, a load of A pushed to the worker (not run
    yet). After the restart A stays pinned for the dead daemon's job: a new
    store evicts B (not A, the older), and the old load, run then, reads A's
    own bytes. After the hold, A is evictable again."""
    with two_block_pool() as (d, s, w, cache):
        _store(s, w, key(2), 1)
        old = s.load([key(1)], [5])
        w._conn.receive(2000)
        w._launch()
        assert old in w._arrived

        _restart(d, s, w)
        info = pool_info(d, "p")
        assert info is not None and info.blocks_ready == 2 and info.blocks_pinned == 1
        assert info.blocks_held == 0
        new = s.store([key(3)], [2])
        assert new is not None and new.evicted_keys == [key(2)], "A was not kept pinned"
        assert new.job_id is not None and w.wait([new.job_id])[new.job_id]
        _until("C ready", lambda: s.finished() is not None and s.lookup([key(3)]) == 1)
        cache[5].zero_()
        assert w.wait([old], timeout_s=5)[old], "the old load did not run"
        assert torch.equal(cache[5], block_content(1, ELEMS)), "the old load read other bytes"

        _until("the dead daemon's pin released",
               lambda: pool_info(d, "p").blocks_pinned == 0, 2.5 * JOB_TIMEOUT_MS / 1000)  # type: ignore[union-attr]  # fmt: skip
        s.touch([key(3)])
        newer = s.store([key(4)], [3])
        assert newer is not None and newer.evicted_keys == [key(1)]


def test_the_hold_covers_two_leases_where_a_lease_is_longer_than_a_job_timeout() -> None:
    """A vLLM worker may start a copy of the dead daemon's slots up to a lease after
    its last answer (SPEC 12): with a lease longer than a job timeout, the warm
    start holds them two leases, not two job timeouts (cold review)."""
    with two_block_pool(lease_ms=4000, job_timeout_ms=1000) as (d, s, w, _):
        kill_and_restart(d, s, w)
        adopted = [line for line in d.log().splitlines() if "event=pool_adopted" in line]
        assert adopted and "held_s=8.0" in adopted[-1], adopted
