"""Runs in the test process: the plug-in's failure rules (SPEC section 12, issue 24).

The plug-in's manager and worker on vLLM's own classes against a real daemon,
as vLLM's offloading connector drives them (`ferry` does what
`KvdOffloadingConnector` does each step: the scheduler side's notes to the
worker before its copies, the worker's reports of its store copies back
before vLLM's completions); one real engine at the end for vLLM's cache reset.
Each of these failed before its fix.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    LookupResult,
    ReqContext,
)

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.scheduler import Scheduler
from kvd_client.vllm import KvdOffloadingSpec
from kvd_client.vllm.manager import (
    RETRY_WAIT_S,
    UNSERVABLE,
    KvdLoadStoreSpec,
    KvdOffloadingManager,
)
from kvd_client.vllm.spec import LOOKUP_TIMEOUT_MS
from kvd_client.vllm.worker import IdleWorker, KvdOffloadingWorker
from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.driver import EngineProcess
from kvd_tools.vllm_harness.engine import write_model
from kvd_tools.vllm_harness.offload_config import offloading_config as config
from tests.vllm.test_spec import device, finish, kv_caches_of, pinned, registered

SLOT = 4096  # bytes a block in `config()`


def key(i: int, group: int = 0) -> bytes:
    """An OffloadKey as vLLM makes them: a 32-byte block hash and a 4-byte group."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def plugin(
    d: DaemonProcess, engine_id: str = "engine-0", **extra: Any
) -> tuple[KvdOffloadingSpec, KvdOffloadingManager, KvdOffloadingWorker, torch.Tensor]:
    extra.setdefault("kvd_capacity_bytes", 1 << 20)
    cfg = dataclasses.replace(config(kvd_endpoint=d.endpoint, **extra), engine_id=engine_id)
    spec = KvdOffloadingSpec(cfg)
    manager = spec.get_manager()
    page = spec.choice.layout.slot_bytes
    tensor = torch.zeros((16, page), dtype=torch.int8)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(tensor, page)], [[CanonicalKVCacheRef(0, page)]]
    )
    worker = spec.get_worker(caches)
    assert isinstance(manager, KvdOffloadingManager) and isinstance(worker, KvdOffloadingWorker)
    worker.reports_load_errors = True  # what KvdOffloadingConnector sets
    return spec, manager, worker, tensor


def ferry(manager: KvdOffloadingManager, worker: KvdOffloadingWorker) -> None:
    """The worker's store reports to the manager, as KvdOffloadingConnector carries them."""
    manager.on_copies({token: (1, copied) for token, copied in worker.take_copies().items()})


def store(
    manager: KvdOffloadingManager,
    worker: KvdOffloadingWorker,
    job_id: int,
    blocks: list[int],
    spec: Any,
    *,
    notes: bool = True,
) -> None:
    """One step of vLLM's worker: the step's notes, then the deferred store copy."""
    if notes:
        worker.note(manager.step_notes())
    assert worker.submit_store(job_id, device(blocks), spec)
    assert finish(worker, job_id) == {job_id: True}  # vLLM asserts it
    ferry(manager, worker)


def stored(manager: KvdOffloadingManager, worker: KvdOffloadingWorker, k: bytes) -> None:
    """`k` stored through the plug-in and ready, from device block 0."""
    out = manager.prepare_store([k], ReqContext("w"))  # type: ignore[list-item]
    assert out is not None
    store(manager, worker, 1, [0], out.store_spec)
    manager.complete_store([k], ReqContext("w"))  # type: ignore[list-item]


def observer(d: DaemonProcess, s: KvdOffloadingSpec) -> Scheduler:
    """Another engine's scheduler on the same pool, asking the daemon (no table)."""
    return Scheduler(s.choice.name, s.choice.layout, engine_id="observer", endpoint=d.endpoint,
                     use_table=False, timeout_ms=10_000)  # fmt: skip


def wait_for(what: str, check: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


# -- 1. a completion names the prepare_store it completes ---------------------------


@pytest.mark.parametrize("between", ["cold restart", "reconnect"])
def test_a_completion_of_an_earlier_session_completes_nothing(between: str) -> None:
    """J1 prepares K; the daemon restarts cold (or the plug-in reconnects and the old
    session's hold on K runs out); J2 prepares K again. J1's completion (vLLM
    names keys only) must not make K ready before J2 copied anything."""
    d = DaemonProcess(restart="cold").start()
    try:
        s, manager, worker, tensor = plugin(d, kvd_ready_table=False)
        scheduler = manager._scheduler
        assert scheduler is not None
        k = key(1)
        first, second = ReqContext("first"), ReqContext("second")
        j1 = manager.prepare_store([k], first)  # type: ignore[list-item]
        assert j1 is not None and j1.keys_to_store == [k]
        epoch = scheduler.epoch
        if between == "cold restart":
            d.kill(signal.SIGKILL)
            d.start()
        else:
            scheduler._conn._drop()  # a timeout's reconnect: a new session
        wait_for("no new session", lambda: scheduler.connected and scheduler.epoch > epoch)
        j2 = None

        def prepared_again() -> bool:  # the old session's hold on K runs out first
            nonlocal j2
            j2 = manager.prepare_store([k], second)  # type: ignore[list-item]
            return j2 is not None and j2.keys_to_store == [k]

        wait_for("K never prepared again", prepared_again)
        assert j2 is not None
        other = observer(d, s)
        try:
            manager.complete_store([k], first)  # type: ignore[list-item]  # J1's completion
            assert other.lookup([k]) is None  # still being stored: not ready, not zeros
            tensor[3] = 7
            store(manager, worker, 2, [3], j2.store_spec)
            manager.complete_store([k], second)  # type: ignore[list-item]  # J2's
            assert other.lookup([k]) == 1
            load = manager.prepare_load([k], second)  # type: ignore[list-item]
            assert worker.submit_load(3, load, device([9]))
            assert finish(worker, 3) == {3: True}
            assert worker.take_load_errors() == set()
            assert tensor[9].eq(7).all()  # J2's bytes
        finally:
            other.close()
        manager.shutdown()
        worker.shutdown()
    finally:
        d.stop()


# -- 2. vLLM's cache reset ------------------------------------------------------------


@pytest.mark.parametrize("flushed", [True, False])
def test_a_reset_fails_the_stores_in_flight_and_releases_the_pins_at_once(
    flushed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM drops the completions of the stores in flight at `reset_cache`: kvd fails
    them as soon as no worker can copy them (the workers flushed them and said so,
    or their deadline passed), so no lookup of theirs answers None for long."""
    with DaemonProcess() as d:
        s, manager, worker, tensor = plugin(d, kvd_ready_table=False)
        ready, flying = key(1), key(2)
        out = manager.prepare_store([ready], ReqContext("w"))  # type: ignore[list-item]
        assert out is not None
        store(manager, worker, 1, [0], out.store_spec)
        manager.complete_store([ready], ReqContext("w"))  # type: ignore[list-item]
        ctx = registered(ReqContext("r"), [ready])
        assert manager.lookup(ready, ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert pinned(d, s.choice.name) == 1
        job = manager.prepare_store([flying], ReqContext("w2"))  # type: ignore[list-item]
        assert job is not None and job.keys_to_store == [flying]
        other = observer(d, s)
        try:
            assert other.lookup([flying]) is None  # being stored
            manager.reset_cache()
            assert pinned(d, s.choice.name) == 0  # at once
            if flushed:  # vLLM's next step flushes the job: the worker refuses it, says so
                tensor[5] = 9
                store(manager, worker, 2, [5], job.store_spec)
                assert other.lookup([flying]) == 0
            else:  # no step: the deadline (a lease, 0.6 s here) and a copy's margin
                assert manager.has_pending_work()  # vLLM keeps stepping
                start = time.monotonic()

                def settled() -> bool:
                    manager.on_schedule_end(None)
                    return other.lookup([flying]) == 0

                wait_for("the store in flight stayed in flight", settled, 5 * d.lease_s + 3)
                assert time.monotonic() - start < d.lease_s + 2.5
            assert not manager.has_pending_work()
            assert other.lookup([ready]) == 1  # kvd keeps what was stored
        finally:
            other.close()
        # The engine reads and writes the pool no more (its weights may have changed).
        assert manager.lookup(ready, registered(ReqContext("r2"), [ready])) is LookupResult.MISS  # type: ignore[arg-type]
        # Nothing stored, and vLLM not asked to offer the blocks again every step.
        off = manager.prepare_store([key(3)], ReqContext("w3"))  # type: ignore[list-item]
        assert off is not None and list(off.keys_to_store) == []
        lines = [r.getMessage() for r in caplog.records if "offloading off" in r.getMessage()]
        assert len(lines) == 1 and "reset_connector=True" in lines[0]
        manager.shutdown()
        worker.shutdown()


def test_vllm_033s_expedited_load_is_done_on_return_or_reported() -> None:
    """vLLM 0.33 submits a sync load with `expedited=True`, then `wait`s on it, and
    the request runs in the same step: its bytes are in place when `wait` returns,
    and a load kvd cannot serve is in `load_errors` for vLLM to recompute."""
    with DaemonProcess() as d:
        _s, manager, worker, tensor = plugin(d, kvd_ready_table=False)
        k = key(1)
        out = manager.prepare_store([k], ReqContext("w"))  # type: ignore[list-item]
        assert out is not None
        tensor[2] = 5
        store(manager, worker, 1, [2], out.store_spec)
        manager.complete_store([k], ReqContext("w"))  # type: ignore[list-item]
        ctx = registered(ReqContext("r"), [k])
        assert manager.lookup(k, ctx) is LookupResult.HIT  # type: ignore[arg-type]
        load = manager.prepare_load([k], ctx)  # type: ignore[list-item]
        assert worker.submit_load(2, load, device([8]), expedited=True)
        worker.wait({2})
        assert tensor[8].eq(5).all()  # before get_finished
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
        assert worker.take_load_errors() == set()
        gone = KvdLoadStoreSpec([0], UNSERVABLE)
        assert worker.submit_load(3, gone, device([9]), expedited=True)
        assert finish(worker, 3) == {3: True}
        assert worker.take_load_errors() == {9}
        manager.shutdown()
        worker.shutdown()


def test_vllm_033s_on_reset_flushed_fails_the_orphaned_stores_at_once() -> None:
    """vLLM 0.33 calls `on_reset_flushed` once every worker reported every job in
    flight at the reset: a store no worker reported (here: never sent to one) then
    fails at once, not a lease and a copy's margin later."""
    with DaemonProcess() as d:
        s, manager, worker, _tensor = plugin(d, kvd_ready_table=False)
        flying = key(2)
        job = manager.prepare_store([flying], ReqContext("w"))  # type: ignore[list-item]
        assert job is not None and job.keys_to_store == [flying]
        other = observer(d, s)
        try:
            manager.reset_cache()
            assert manager.has_pending_work()  # its deadline has not passed
            assert other.lookup([flying]) is None  # still being stored
            start = time.monotonic()
            manager.on_reset_flushed()
            assert other.lookup([flying]) == 0  # failed: its slot is free, nobody waits
            assert not manager.has_pending_work()
            assert time.monotonic() - start < d.lease_s
        finally:
            other.close()
        manager.shutdown()
        worker.shutdown()


# -- 3. long prompts: bounded requests, no exception ---------------------------------


def test_a_lookup_of_100k_keys_without_the_table_answers_a_count() -> None:
    n, ready = 100_000, 70_000
    keys = [key(i) for i in range(n)]
    # A lease that outlasts the daemon's loop on these long requests (2 to 10 us a key).
    with DaemonProcess(lease_ms="5000") as d:
        s, manager, worker, _ = plugin(
            d, kvd_ready_table=False, bytes_per_block=64, kvd_capacity_bytes=64 << 20
        )
        other = observer(d, s)
        try:
            for i in range(0, ready, 5_000):  # stored in requests the daemon takes
                part = keys[i : i + 5_000]
                assert other.prepare_store(part) is not None
                assert other.complete_store(part)
            assert other.lookup(keys) == ready  # one Scheduler.lookup, split
            assert other.lookup_and_pin(keys)[0] == ready
            other.complete_load(keys[:ready])
        finally:
            other.close()
        ctx = registered(ReqContext("long"), keys)
        assert manager.lookup(keys[0], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert manager.lookup(keys[ready - 1], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert manager.lookup(keys[ready], ctx) is LookupResult.MISS  # type: ignore[arg-type]
        load = manager.prepare_load(keys[:ready], ctx)  # type: ignore[arg-type]
        assert isinstance(load, KvdLoadStoreSpec) and load.generation != UNSERVABLE
        assert len(load.block_ids) == ready
        manager.complete_load(keys[:ready], ctx)  # type: ignore[arg-type]
        out = manager.prepare_store(keys, ReqContext("w"))  # type: ignore[arg-type]
        assert out is not None and len(out.keys_to_store) == n - ready
        manager.shutdown()
        worker.shutdown()


# -- 10. a failed copy is a store not completed, a load recomputed ------------------


def test_a_failed_store_copy_is_a_store_failed_not_an_exception() -> None:
    with DaemonProcess() as d:
        s, manager, worker, _ = plugin(d, kvd_ready_table=False)
        k = key(1)
        out = manager.prepare_store([k], ReqContext("w"))  # type: ignore[list-item]
        assert out is not None
        # A device block vLLM does not have: the copy fails (as a CUDA error or an
        # out-of-memory `.cpu()` would), inside submit_store.
        store(manager, worker, 1, [10**6], out.store_spec)
        manager.complete_store([k], ReqContext("w"))  # type: ignore[list-item]
        other = observer(d, s)
        try:
            assert other.lookup([k]) == 0  # failed: not ready, and not left in flight
        finally:
            other.close()
        stats = manager.get_stats()
        assert stats is not None and stats.reduce()["vllm:kv_offload_kvd_stores_failed"] == 1
        # A failed load copy: handed back to recompute.
        assert worker.submit_load(2, KvdLoadStoreSpec([10**6], out.store_spec.generation),  # type: ignore[attr-defined]
                                  device([4]))  # fmt: skip
        assert finish(worker, 2) == {2: True}
        assert worker.take_load_errors() == {4}
        manager.shutdown()
        worker.shutdown()


def test_under_vllms_plain_connector_kvd_is_off_with_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's plain OffloadingConnector could neither recompute a load kvd could not
    serve nor hear of a failed copy: kvd refuses to run under it."""
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(config(kvd_endpoint=d.endpoint, kvd_connector=False))
        manager = spec.get_manager()
        off = manager.prepare_store([key(1)], ReqContext("w"))  # type: ignore[list-item]
        assert off is not None and list(off.keys_to_store) == []  # stored nowhere
        worker = spec.get_worker(kv_caches_of(torch.zeros((4, SLOT), dtype=torch.int8)))
        assert isinstance(worker, IdleWorker)
        (line, *_) = [r.getMessage() for r in caplog.records if "offloading off" in r.getMessage()]
        assert "KvdOffloadingConnector" in line and "plain OffloadingConnector" in line


# -- 11. no copy past its deadline ----------------------------------------------------


def test_a_store_copied_after_its_session_was_rolled_back_is_refused() -> None:
    """Engine A prepares K1 into the pool's one slot and stalls past two leases: the
    daemon rolls A back and gives the slot to engine B's K2. A's worker copies a
    step later: refused (its deadline passed), never over B's block."""
    with DaemonProcess() as d:
        a = plugin(d, "engine-a", kvd_pool="one", kvd_capacity_bytes=SLOT, kvd_ready_table=False)
        b = plugin(d, "engine-b", kvd_pool="one", kvd_capacity_bytes=SLOT, kvd_ready_table=False)
        (_, manager_a, worker_a, tensor_a), (_, manager_b, worker_b, tensor_b) = a, b
        late = manager_a.prepare_store([key(1)], ReqContext("a"))  # type: ignore[list-item]
        assert late is not None and late.keys_to_store == [key(1)]
        scheduler_a = manager_a._scheduler
        assert scheduler_a is not None
        with scheduler_a._conn._lock:  # A's process stalls: not even a heartbeat
            ours = None

            def slot_given_to_b() -> bool:
                nonlocal ours
                ours = manager_b.prepare_store([key(2)], ReqContext("b"))  # type: ignore[list-item]
                return ours is not None and ours.keys_to_store == [key(2)]

            wait_for("the slot never came free", slot_given_to_b, 5 * d.lease_s + 5)
            assert ours is not None
            tensor_b[0] = 2
            store(manager_b, worker_b, 1, [0], ours.store_spec)
            manager_b.complete_store([key(2)], ReqContext("b"))  # type: ignore[list-item]
        tensor_a[0] = 1
        store(manager_a, worker_a, 1, [0], late.store_spec)  # A's deferred copy, late
        load = manager_b.prepare_load([key(2)], ReqContext("b"))  # type: ignore[list-item]
        assert worker_b.submit_load(2, load, device([8]))
        assert finish(worker_b, 2) == {2: True}
        assert tensor_b[8].eq(2).all(), "A's late copy landed in B's block"
        for manager, worker in ((manager_a, worker_a), (manager_b, worker_b)):
            manager.shutdown()
            worker.shutdown()


def test_a_step_longer_than_the_lease_still_stores_while_the_session_lives() -> None:
    """The deadline follows the session, renewed each step (vLLM copies a store a
    step after its prepare, and a step may take longer than a lease)."""
    with DaemonProcess() as d:
        s, manager, worker, tensor = plugin(d, kvd_ready_table=False)
        k = key(1)
        out = manager.prepare_store([k], ReqContext("w"))  # type: ignore[list-item]
        assert out is not None
        time.sleep(3 * d.lease_s)  # a long forward; the keeper heartbeats meanwhile
        tensor[2] = 5
        store(manager, worker, 1, [2], out.store_spec)  # with this step's notes
        manager.complete_store([k], ReqContext("w"))  # type: ignore[list-item]
        other = observer(d, s)
        try:
            assert other.lookup([k]) == 1
        finally:
            other.close()
        manager.shutdown()
        worker.shutdown()


# -- 2. new weights at the same path: another pool -------------------------------------


def test_new_weights_at_the_same_path_get_another_pool(tmp_path: Path) -> None:
    """A model directory whose weights file is rewritten (the same name and size,
    other bytes, a later mtime): the fingerprint, so the default pool, changes."""
    from safetensors.torch import save_file
    from vllm.engine.arg_utils import EngineArgs

    from kvd_client.vllm.connector import weights_fingerprint
    from kvd_client.vllm.pool import choose_pool

    model = write_model(tmp_path / "m")
    weights = Path(model) / "model.safetensors"

    def write(seed: int) -> None:
        tensor = torch.randn((64, 64), generator=torch.Generator().manual_seed(seed))
        save_file({"w": tensor}, str(weights))

    def fingerprint() -> str:
        args = EngineArgs(model=model, skip_tokenizer_init=True, load_format="safetensors")
        return weights_fingerprint(args.create_engine_config())

    write(0)
    before = fingerprint()
    assert fingerprint() == before  # stable
    st = weights.stat()
    write(1)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert weights.stat().st_size == st.st_size
    after = fingerprint()
    assert after != before
    names = {choose_pool(config(kvd_weights=f)).name for f in (before, after)}
    assert len(names) == 2


def test_a_store_prepared_by_the_session_a_reconnect_opened_is_failed_not_left() -> None:
    """The keeper's reconnect wins the race between the manager's read of its session
    and its prepare_store: the new session answers it, the manager drops the output
    (vLLM gets no store), and must fail it there, or the keys stay in flight while the
    session lives and every engine's lookup of them answers RETRY (cold review)."""
    with DaemonProcess() as d:
        spec, manager, _, _ = plugin(d, kvd_ready_table=False)
        scheduler = manager._scheduler
        assert scheduler is not None
        prepare = scheduler.prepare_store

        def racing(keys: Any) -> Any:
            epoch = scheduler.epoch
            scheduler._conn._drop()  # what the keeper does after a heartbeat timed out
            wait_for("the reconnect", lambda: scheduler.connected and scheduler.epoch > epoch)
            return prepare(keys)

        scheduler.prepare_store = racing  # type: ignore[method-assign]
        assert manager.prepare_store([key(7)], ReqContext("r1")) is None
        scheduler.prepare_store = prepare  # type: ignore[method-assign]
        other = observer(d, spec)
        try:
            assert other.lookup([key(7)]) == 0  # failed: a miss, not "being stored"
        finally:
            other.close()
            manager.shutdown()


def test_a_finished_loads_release_and_touch_never_wait_for_the_daemon() -> None:
    """vLLM's step goes on at once after a load: the manager releases its pins and
    sends the touch without waiting for the daemon's reply (waiting, on a stopped
    daemon, would hold the step for LOOKUP_TIMEOUT_MS); the daemon takes both once
    it runs again."""
    with DaemonProcess(lease_ms="10000") as d:
        s, manager, worker, _ = plugin(d)
        k = key(1)
        stored(manager, worker, k)
        ctx = registered(ReqContext("r"), [k])
        assert manager.lookup(k, ctx) is LookupResult.HIT  # type: ignore[arg-type]
        manager.prepare_load([k], ctx)  # type: ignore[list-item]
        assert pinned(d, s.choice.name) == 1
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            manager.complete_load([k], ctx)  # type: ignore[list-item]
            manager.touch([k], ctx)  # type: ignore[list-item]
            took = time.monotonic() - t0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert took < LOOKUP_TIMEOUT_MS / 1000 / 5, f"the step waited {took:.3f} s"
        wait_for("the release never reached the daemon", lambda: pinned(d, s.choice.name) == 0)
        assert manager._scheduler is not None and manager._scheduler.connected
        manager.shutdown()
        worker.shutdown()


def test_a_new_engines_store_of_blocks_the_pool_has_is_not_a_skipped_store() -> None:
    """A new engine (no round trip of its session answered yet) is offered blocks the
    pool holds: the ready table answers that there is nothing to store, and vLLM is
    told so, not that the store failed (which vLLM logs and asks again every step)."""
    with DaemonProcess(lease_ms="10000") as d:
        _, manager, worker, _ = plugin(d)
        k = key(1)
        stored(manager, worker, k)
        _, fresh, fresh_worker, _ = plugin(d, engine_id="engine-1")
        try:
            again = fresh.prepare_store([k], ReqContext("w2"))  # type: ignore[list-item]
            assert again is not None and list(again.keys_to_store) == []
            assert fresh._counters._counts.get("stores_skipped", 0) == 0
            assert fresh._counters._counts.get("stores_present") == 1  # and counted as such
        finally:
            fresh.shutdown()
            fresh_worker.shutdown()
            manager.shutdown()
            worker.shutdown()


def test_with_the_daemon_gone_a_store_is_skipped_not_offered_again_every_step() -> None:
    """The daemon stopped: the manager answers vLLM "nothing to store", not None.
    None makes vLLM log "cannot store chunks" and offer the request's blocks again
    every step, more each step, for as long as the daemon is away (measured: a
    decode step 1.11x to 1.17x the no-connector engine's with no daemon, against
    kvd's 1.07x to 1.13x). A pool with no room still answers None: vLLM asks
    again, and the blocks may fit next step."""
    with DaemonProcess(lease_ms="10000") as d:
        _, manager, worker, _ = plugin(d)
        scheduler = manager._scheduler
        assert scheduler is not None
        try:
            too_many = [key(100 + i) for i in range((1 << 20) // SLOT + 1)]  # past capacity
            assert manager.prepare_store(too_many, ReqContext("full")) is None  # type: ignore[arg-type]
            assert scheduler.connected
            d.stop()
            deadline = time.monotonic() + 10
            while scheduler.connected and time.monotonic() < deadline:
                manager.prepare_store([key(3)], ReqContext("gone"))  # type: ignore[list-item]
                time.sleep(0.05)
            assert not scheduler.connected, "the session outlived its daemon"
            for i in range(3):  # every later step's offer too
                out = manager.prepare_store([key(4 + i)], ReqContext("gone"))  # type: ignore[list-item]
                assert out is not None and list(out.keys_to_store) == []
                assert list(out.evicted_keys) == []
            assert manager._counters._counts.get("stores_skipped", 0) >= 3
        finally:
            manager.shutdown()
            worker.shutdown()


@pytest.mark.parametrize("lease_ms", [200, 2000])
def test_a_lookup_answers_retry_for_a_bounded_time(lease_ms: int) -> None:
    """Another engine's store that never completes (its scheduler stuck, its session
    kept alive by the keeper): RETRY for RETRY_WAIT_S or two leases, whichever is
    shorter, then a miss, counted."""
    bound = min(2 * lease_ms / 1000, RETRY_WAIT_S)
    with DaemonProcess(lease_ms=str(lease_ms)) as d:
        spec, manager, _, _ = plugin(d)
        stuck = observer(d, spec)
        try:
            out = stuck.prepare_store([key(3)])
            assert out is not None and list(out.keys_to_store) == [key(3)]
            ctx = ReqContext("waiting")
            ctx._offload_key_positions = {key(3): 32}  # type: ignore[attr-defined]
            t0 = time.monotonic()
            answers = []
            while not answers or answers[-1] == LookupResult.RETRY:
                assert time.monotonic() - t0 < 10, "RETRY had no bound"
                answers.append(manager.lookup(key(3), ctx))
                manager.on_schedule_end(None)  # the next scheduler step
                time.sleep(0.05)
            waited = time.monotonic() - t0
            assert answers[0] == LookupResult.RETRY and answers[-1] == LookupResult.MISS
            assert bound <= waited < bound + 2.0, waited  # two leases would be 4 s
            assert manager._counters._counts.get("retries_given_up") == 1
        finally:
            stuck.close()
            manager.shutdown()


def test_two_commits_of_a_hub_model_at_main_get_two_pools() -> None:
    """vLLM keeps a hub id's revision as huggingface_hub's ResolvedRevision, whose text
    is the revision asked ("main") and whose `resolved` is the commit: two commits
    of one branch are other weights, so other pools (they shared one before)."""
    from types import SimpleNamespace

    from huggingface_hub._revision import ResolvedRevision

    from kvd_client.vllm.connector import weights_fingerprint

    def fingerprint(commit: str) -> str:
        model = SimpleNamespace(revision=ResolvedRevision(commit), quantization=None,
                                hf_overrides={}, model="org/model", seed=0)  # fmt: skip
        load = SimpleNamespace(load_format="auto")
        return weights_fingerprint(SimpleNamespace(model_config=model, load_config=load))

    assert str(ResolvedRevision("a" * 40)) == "main"
    assert fingerprint("a" * 40) == fingerprint("a" * 40)
    assert fingerprint("a" * 40) != fingerprint("b" * 40)


# -- a real engine: vLLM's reset_prefix_cache(reset_connector=True) ----------------------

PREFIX = [(i * 37) % 1000 + 3 for i in range(256)]
PROMPTS = [PREFIX + [(i * 11 + j * 101) % 1000 + 3 for i in range(96)] for j in range(2)]


def test_an_engine_answers_after_vllms_connector_reset(tmp_path: Path) -> None:
    """After `reset_prefix_cache(reset_connector=True)` the engine answers the same
    prompts within a bound, with the tokens it gave before (recomputed: it reads
    the pool no more), and says so in its log."""
    model = write_model(tmp_path / "tiny-llama")
    with DaemonProcess(lease_ms="3000") as d:
        kvd = {"kvd_endpoint": d.endpoint, "kvd_capacity_bytes": 64 << 20}
        engine = EngineProcess({"model": model, "kvd": kvd})
        try:
            first = engine.generate(PROMPTS)
            reply = engine.ask({"reset_prefix_cache": True, "reset_connector": True}, timeout=60)
            assert reply == {"ok": True}
            start = time.monotonic()
            again = engine.generate(PROMPTS)
            assert time.monotonic() - start < 60
            assert again == first  # greedy tokens
            figures = engine.metrics()
            assert figures.get("vllm:kv_offload_kvd_unservable_loads", 0) == 0
            assert "kvd offloading off for this engine: vLLM reset" in engine.log_tail(200_000)
        finally:
            engine.stop()
        # What it stored before the reset stays for the engines that share its pool.
        assert sum(info.blocks_ready for info in pools(d)) >= 8


def pools(d: DaemonProcess) -> list[p.PoolInfo]:
    conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        reply = conn.call(p.Pools)
        assert isinstance(reply, p.PoolsResult)
        return list(reply.pools)
    finally:
        conn.close()
