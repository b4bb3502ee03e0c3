"""Runs in the test process: `KvdOffloadingSpec` on configs built as vLLM builds them (no engine)."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingManager,
    OffloadingWorker,
    ReqContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.paths import read_admin_token
from kvd_client.vllm import KvdOffloadingSpec
from kvd_client.vllm.manager import UNSERVABLE, KvdLoadStoreSpec
from kvd_client.vllm.pool import choose_pool
from kvd_client.vllm.worker import IdleWorker, KvdOffloadingWorker
from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.offload_config import offloading_config as config


def test_the_default_pool_follows_what_makes_blocks_interchangeable() -> None:
    base = choose_pool(config())
    assert base.name == choose_pool(config()).name  # stable
    assert base.layout.slot_bytes == 4096 and base.layout.block_tokens == 32
    for other in (
        config(model="other"),
        config(world_size=2),
        config(world_size=2, replicated=True),
        config(blocks_per_chunk=2),
    ):
        assert choose_pool(other).name != base.name
    named = choose_pool(config(kvd_pool="shared", kvd_capacity_bytes=1 << 20))
    assert (named.name, named.capacity_bytes) == ("shared", 1 << 20)


def test_the_replicated_layout_maps_to_a_replicated_pool() -> None:
    spec = KvdOffloadingSpec(config(world_size=2, replicated=True))
    assert spec.replicated_layout
    assert spec.choice.layout.replicated and spec.choice.layout.world_size == 2


@pytest.mark.parametrize(
    ("cfg", "why"),
    [
        (config(kvd_connector=False), "vLLM's plain OffloadingConnector"),
        (config(groups=2, kvd_refuse="a reason"), "a reason"),
    ],
)
def test_what_kvd_cannot_hold_turns_offloading_off_with_one_line(
    cfg: OffloadingConfig, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = KvdOffloadingSpec(cfg).get_manager()
    ctx = ReqContext("r")
    assert manager.lookup(b"k" * 36, ctx) is LookupResult.MISS  # type: ignore[arg-type]
    off = manager.prepare_store([b"k" * 36], ctx)  # type: ignore[list-item]
    assert off is not None and list(off.keys_to_store) == []  # stored nowhere, not asked again
    (line,) = [r.getMessage() for r in caplog.records if "kvd offloading off" in r.getMessage()]
    assert line.startswith(f"kvd offloading off for this engine: {why}")


def test_an_explicit_pool_with_another_layout_is_off_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with DaemonProcess() as d:
        first = KvdOffloadingSpec(
            config(kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_pool="p")
        )
        assert first.get_manager().prepare_store([b"a" * 36], ReqContext("r")) is not None
        other = KvdOffloadingSpec(
            config(kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_pool="p", world_size=2)
        )
        manager = other.get_manager()
        assert manager.lookup(b"a" * 36, ReqContext("r")) is LookupResult.MISS  # type: ignore[arg-type]
        assert any("LAYOUT_MISMATCH" in r.message for r in caplog.records)
        first.get_manager().shutdown()
        manager.shutdown()


# -- the worker and the manager on vLLM's own classes, against a real daemon -------


def device(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=(len(ids),), block_indices=(0,))


KEYS = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(1, 4)]


def store_and_pin(
    spec: KvdOffloadingSpec, tensor: torch.Tensor, ctx: ReqContext
) -> tuple[OffloadingManager, OffloadingWorker]:
    """Stores KEYS from device blocks 0..2 (bytes 1, 2, 3) and looks them up in `ctx`."""
    manager, worker = spec.get_manager(), spec.get_worker(kv_caches_of(tensor))
    for i in range(3):
        tensor[i] = i + 1
    out = manager.prepare_store(KEYS, ctx)  # type: ignore[arg-type]
    assert out is not None
    assert worker.submit_store(1, device([0, 1, 2]), out.store_spec)
    finish(worker, 1)
    report(manager, worker)
    manager.complete_store(KEYS, ctx)  # type: ignore[arg-type]
    for i, key in enumerate(KEYS):
        ctx.set_offload_key_position(key, (i + 1) * 32)  # type: ignore[arg-type]
    assert [manager.lookup(k, ctx) for k in KEYS] == [LookupResult.HIT] * 3  # type: ignore[arg-type]
    return manager, worker


def finish(worker: OffloadingWorker, *job_ids: int) -> dict[int, bool]:
    """What vLLM's worker does with copies it needs done: `wait`, then `get_finished`
    (whose jobs' failures the worker's `take_*` then tell); each job's success."""
    worker.wait(set(job_ids))
    return {r.job_id: r.success for r in worker.get_finished()}


def report(manager: OffloadingManager, worker: OffloadingWorker) -> None:
    """The worker's reports of its store copies to the manager, as
    KvdOffloadingConnector carries them: a store becomes ready only with them."""
    copies = worker.take_copies()  # type: ignore[attr-defined]
    manager.on_copies({token: (1, copied) for token, copied in copies.items()})  # type: ignore[attr-defined]


def copied(manager: OffloadingManager, out: Any) -> None:
    """As `report`, for a store no test reads back: its one worker copied it."""
    manager.on_copies({out.store_spec.token: (1, True)})  # type: ignore[attr-defined]


def kv_caches_of(tensor: torch.Tensor) -> CanonicalKVCaches:
    return CanonicalKVCaches(
        [CanonicalKVCacheTensor(tensor, 4096)], [[CanonicalKVCacheRef(0, 4096)]]
    )


def test_a_load_kvd_cannot_serve_is_reported_as_load_errors_not_a_failed_transfer() -> None:
    tensor = torch.zeros((16, 4096), dtype=torch.int8)
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(
            config(kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_capacity_bytes=1 << 20)
        )
        ctx = ReqContext("r")
        manager, worker = store_and_pin(spec, tensor, ctx)
        assert isinstance(worker, KvdOffloadingWorker)
        worker.reports_load_errors = True  # what KvdOffloadingConnector sets
        good = manager.prepare_load(KEYS, ctx)  # type: ignore[arg-type]
        assert worker.submit_load(2, good, device([5, 6, 7]))
        worker.wait({2})
        assert tensor[5:8, 0].tolist() == [1, 2, 3]
        # A segment that is gone (its daemon ended) and a load kvd could not pin:
        gone = KvdLoadStoreSpec(list(good.block_ids), generation=good.generation + 1000)
        assert worker.submit_load(3, gone, device([8, 9]))
        assert worker.submit_load(4, KvdLoadStoreSpec([0], UNSERVABLE), device([10]))
        results = finish(worker, 3, 4)
        assert results == {2: True, 3: True, 4: True}  # vLLM asserts success
        assert worker.take_load_errors() == {8, 9, 10}
        assert worker.take_load_errors() == set()
        assert tensor[8:11].abs().sum() == 0  # nothing was written there
        # No exception reaches vLLM (under its plain connector kvd is off: see
        # test_failure_rules_vllm): a load not served is reported, whoever asks.
        worker.reports_load_errors = False
        assert worker.submit_load(5, gone, device([8]))
        assert finish(worker, 5) == {5: True}
        assert worker.take_load_errors() == {8}
        manager.shutdown()
        worker.shutdown()


def test_a_load_without_a_pin_is_pinned_then_or_handed_back_to_recompute() -> None:
    tensor = torch.zeros((16, 4096), dtype=torch.int8)
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(
            config(kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_capacity_bytes=1 << 20)
        )
        ctx = ReqContext("r")
        manager, worker = store_and_pin(spec, tensor, ctx)
        scheduler = manager._scheduler  # type: ignore[attr-defined]
        epoch = scheduler.epoch
        scheduler._conn._drop()  # a reconnect (a timeout, say): the pins went with the session
        deadline = time.monotonic() + 30
        while not (scheduler.connected and scheduler.epoch > epoch):
            assert time.monotonic() < deadline, "the plug-in never reconnected"
            time.sleep(0.05)
        again = manager.prepare_load(KEYS[:2], ctx)  # type: ignore[arg-type]
        assert isinstance(again, KvdLoadStoreSpec) and again.generation != UNSERVABLE
        assert worker.submit_load(1, again, device([4, 5]))
        assert finish(worker, 1) == {1: True}
        assert tensor[4:6, 0].tolist() == [1, 2]
        manager.complete_load(KEYS[:2], ctx)  # type: ignore[arg-type]
        conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=2000)
        conn.connect()
        try:
            token = read_admin_token(d.runtime_dir)
            assert isinstance(conn.call(p.DropPool, spec.choice.name, token), p.Ok)
        finally:
            conn.close()
        lost = manager.prepare_load(KEYS, ReqContext("other"))  # type: ignore[arg-type]
        assert isinstance(lost, KvdLoadStoreSpec) and lost.generation == UNSERVABLE
        stats = manager.get_stats()
        assert stats is not None
        figures = stats.reduce()
        assert figures["vllm:kv_offload_kvd_unservable_loads"] == 1
        assert figures["vllm:kv_offload_kvd_lookup_rpcs"] == 1
        assert figures["vllm:kv_offload_kvd_lookup_hit_keys"] == 3
        assert figures["vllm:kv_offload_kvd_stored_keys"] == 3
        assert set(figures) <= set(KvdOffloadingSpec.build_metric_definitions({}))
        assert manager.get_stats() is None  # counted once
        manager.shutdown()
        worker.shutdown()


def test_events_name_this_engines_stores_and_evictions_when_vllm_asks() -> None:
    with DaemonProcess() as d:
        cfg = config(
            kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_capacity_bytes=2 * 4096, events=True
        )
        manager = KvdOffloadingSpec(cfg).get_manager()
        ctx = ReqContext("r")
        first = manager.prepare_store(KEYS[:2], ctx)  # type: ignore[arg-type]
        assert first is not None
        copied(manager, first)
        manager.complete_store(KEYS[:2], ctx)  # type: ignore[arg-type]
        out = manager.prepare_store(KEYS[2:], ctx)  # type: ignore[arg-type]
        assert out is not None and len(out.evicted_keys) == 1
        copied(manager, out)
        manager.complete_store(KEYS[2:], ctx)  # type: ignore[arg-type]
        events = list(manager.take_events())
        assert [(e.keys, e.removed, e.medium) for e in events] == [
            (KEYS[:2], False, Medium.CPU),
            (list(out.evicted_keys), True, Medium.CPU),
            (KEYS[2:], False, Medium.CPU),
        ]
        assert list(manager.take_events()) == []
        manager.shutdown()


def pinned(d: DaemonProcess, pool: str) -> int:
    conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=2000)
    conn.connect()
    try:
        reply = conn.call(p.Pools)
        assert isinstance(reply, p.PoolsResult)
        return next(pi.blocks_pinned for pi in reply.pools if pi.name == pool)
    finally:
        conn.close()


def registered(ctx: ReqContext, keys: list[bytes]) -> ReqContext:
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * 32)  # type: ignore[arg-type]
    return ctx


def test_one_round_trip_a_request_a_step_even_while_a_key_is_being_stored() -> None:
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(
            config(kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_capacity_bytes=1 << 20)
        )
        manager = spec.get_manager()
        keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(10, 20)]
        writer = ReqContext("w")
        out = manager.prepare_store(keys[:1], writer)  # type: ignore[arg-type]
        assert out is not None
        copied(manager, out)
        ctx = registered(ReqContext("r"), keys)
        assert {manager.lookup(k, ctx) for k in keys} == {LookupResult.RETRY}  # type: ignore[arg-type]
        stats = manager.get_stats()
        assert stats is not None and stats.reduce()["vllm:kv_offload_kvd_lookup_rpcs"] == 1
        manager.complete_store(keys[:1], writer)  # type: ignore[arg-type]
        assert manager.lookup(keys[0], ctx) is LookupResult.RETRY  # type: ignore[arg-type]
        manager.on_schedule_end(None)  # the next step may ask the daemon again
        assert manager.lookup(keys[0], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert manager.lookup(keys[1], ctx) is LookupResult.MISS  # type: ignore[arg-type]
        stats = manager.get_stats()
        assert stats is not None and stats.reduce()["vllm:kv_offload_kvd_lookup_rpcs"] == 1
        manager.shutdown()


def test_pins_start_at_the_first_key_vllm_asks_and_unloaded_ones_go_at_the_load() -> None:
    tensor = torch.zeros((16, 4096), dtype=torch.int8)
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(
            config(kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_capacity_bytes=1 << 20)
        )
        manager, worker = store_and_pin(spec, tensor, ReqContext("first"))
        manager.on_request_finished(ReqContext("first"))
        assert pinned(d, spec.choice.name) == 0
        # vLLM's own cache holds block 0: it asks from key 1, so kvd pins keys 1 and 2 only.
        ctx = registered(ReqContext("r"), KEYS)
        assert manager.lookup(KEYS[1], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert manager.lookup(KEYS[2], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        assert pinned(d, spec.choice.name) == 2
        spec_ = manager.prepare_load(KEYS[1:2], ctx)  # type: ignore[arg-type]
        assert pinned(d, spec.choice.name) == 1  # key 2's pin went: vLLM does not load it
        assert worker.submit_load(1, spec_, device([9]))
        assert finish(worker, 1) == {1: True}
        assert tensor[9, 0].item() == 2
        manager.complete_load(KEYS[1:2], ctx)  # type: ignore[arg-type]
        # Sent without waiting: the daemon has it before the session's next request.
        assert manager._scheduler is not None and manager._scheduler.stats()
        assert pinned(d, spec.choice.name) == 0
        manager.shutdown()
        worker.shutdown()


@pytest.mark.parametrize("restart", ["cold", "warm"])
def test_pins_of_a_daemon_that_restarted_are_not_trusted(restart: str) -> None:
    """The pins went with the daemon: `prepare_load` pins again. Cold, the blocks
    are gone (UNSERVABLE: vLLM recomputes); warm, they came back in their slots."""
    tensor = torch.zeros((16, 4096), dtype=torch.int8)
    d = DaemonProcess(lease_ms="3000", restart=restart).start()
    try:
        spec = KvdOffloadingSpec(
            config(kvd_ready_table=False, kvd_endpoint=d.endpoint, kvd_capacity_bytes=1 << 20)
        )
        ctx = ReqContext("r")
        manager, worker = store_and_pin(spec, tensor, ctx)
        scheduler = spec.get_manager()._scheduler  # type: ignore[attr-defined]
        epoch = scheduler.epoch
        epoch_generation = scheduler.attached.generation
        d.kill(signal.SIGKILL)
        d.start()
        deadline = time.monotonic() + 30
        while not (scheduler.connected and scheduler.epoch > epoch):
            assert time.monotonic() < deadline, "the plug-in never reconnected"
            time.sleep(0.05)
        again = manager.prepare_load(KEYS, ctx)  # type: ignore[arg-type]
        assert isinstance(again, KvdLoadStoreSpec)
        if restart == "cold":  # the pool is empty
            assert again.generation == UNSERVABLE
            manager.on_schedule_end(None)
            assert manager.lookup(KEYS[0], ctx) is LookupResult.MISS  # type: ignore[arg-type]
        else:  # adopted: pinned again in the same segment
            assert again.generation == epoch_generation
        manager.shutdown()
        worker.shutdown()
    finally:
        d.stop()


def test_an_engine_kvd_cannot_hold_gets_an_idle_worker_not_an_exception() -> None:
    spec = KvdOffloadingSpec(config(kvd_connector=False))
    worker = spec.get_worker(kv_caches_of(torch.zeros((4, 4096), dtype=torch.int8)))
    assert isinstance(worker, IdleWorker)
    assert worker.submit_load(1, KvdLoadStoreSpec([0], 0), device([3]))
    assert [r.success for r in worker.get_finished()] == [True]
    assert worker.take_load_errors() == {3}


def test_with_the_ready_table_lookups_cost_no_round_trip_and_the_load_pins() -> None:
    tensor = torch.zeros((16, 4096), dtype=torch.int8)
    with DaemonProcess() as d:
        spec = KvdOffloadingSpec(config(kvd_endpoint=d.endpoint, kvd_capacity_bytes=8 * 4096))
        manager, worker = store_and_pin(spec, tensor, ReqContext("first"))
        assert isinstance(worker, KvdOffloadingWorker)
        worker.reports_load_errors = True
        assert spec.get_manager()._scheduler.table is not None  # type: ignore[attr-defined]
        stats = manager.get_stats()
        assert stats is not None
        assert "vllm:kv_offload_kvd_lookup_rpcs" not in stats.reduce()  # none at all
        assert pinned(d, spec.choice.name) == 0  # nothing pinned by a lookup
        load = manager.prepare_load(KEYS, ReqContext("first"))  # type: ignore[arg-type]
        assert pinned(d, spec.choice.name) == 3  # pinned now, by the load
        assert worker.submit_load(1, load, device([7, 8, 9]))
        assert finish(worker, 1) == {1: True}
        assert tensor[7:10, 0].tolist() == [1, 2, 3]
        manager.complete_load(KEYS, ReqContext("first"))  # type: ignore[arg-type]
        # Evicted between the lookup and the load: refused at the load, recomputed.
        ctx = registered(ReqContext("late"), KEYS)
        assert manager.lookup(KEYS[0], ctx) is LookupResult.HIT  # type: ignore[arg-type]
        other = [bytes([i]) * 32 + b"\0\0\0\1" for i in range(50, 58)]
        assert manager.prepare_store(other, ReqContext("w")) is not None  # type: ignore[arg-type]
        lost = manager.prepare_load(KEYS, ctx)  # type: ignore[arg-type]
        assert isinstance(lost, KvdLoadStoreSpec) and lost.generation == UNSERVABLE
        assert worker.submit_load(2, lost, device([11, 12, 13]))
        assert finish(worker, 2) == {2: True}
        assert worker.take_load_errors() == {11, 12, 13}
        manager.shutdown()
        worker.shutdown()


def test_the_connector_names_the_core_vllms_cpu_build_reserves_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's CPU build reserves a core a rank more for any KV connector; on a host
    with no more cores than that it reserves none (decode steps slower): a
    warning with the variable that fixes it, nothing once it is set."""
    import logging
    import os
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from kvd_client.vllm.connector import RESERVED_CPU_ENV, reserved_cores_note

    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(local_world_size=1, world_size=1))
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)  # also on a GPU build
    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    note = reserved_cores_note(vllm_config)
    assert note is not None and note[0] == logging.WARNING
    assert f"{RESERVED_CPU_ENV}=1" in note[1] and "With 2 CPUs" in note[1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    note = reserved_cores_note(vllm_config)
    assert note is not None and note[0] == logging.INFO and f"{RESERVED_CPU_ENV}=1" in note[1]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # bound by hand: nothing reserved
    assert reserved_cores_note(vllm_config) is None
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setenv(RESERVED_CPU_ENV, "1")
    assert reserved_cores_note(vllm_config) is None
