"""Runs in the test process: the plug-in worker's asynchronous copies on the CPU (both modes).

`submit_*` launches and returns, `get_finished` reports (and settles) what
is done, `wait` blocks for the named jobs only; a job's copy starts only if
it is not late by then, a failed copy is a store not copied, and a job keeps
its segment mapped through generation changes until it is done. The copy
thread is held at the start of a job (its deadline check) to make "still
running" deterministic.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any

import numpy as np
import posix_ipc
import pytest
import torch
from vllm.v1.kv_offload.base import ReqContext

from kvd_client import protocol as p
from kvd_client.vllm.copies import KEEP_SEGMENTS, Copies
from kvd_client.vllm.spec import KvdOffloadingSpec
from kvd_client.vllm.worker import KvdOffloadingWorker
from kvd_tools.launcher import DaemonProcess
from kvd_tools.vllm_harness.offload_config import offloading_config as config
from tests.vllm.test_failure_rules_vllm import key
from tests.vllm.test_spec import device, finish, kv_caches_of

MODES = ["sync", "thread"]


def plugin(d: DaemonProcess, mode: str) -> tuple[Any, KvdOffloadingWorker, torch.Tensor]:
    cfg = config(kvd_endpoint=d.endpoint, kvd_capacity_bytes=1 << 20, kvd_copies=mode,
                 kvd_ready_table=False)  # fmt: skip
    spec = KvdOffloadingSpec(dataclasses.replace(cfg, engine_id=f"e-{mode}"))
    tensor = torch.zeros((16, 4096), dtype=torch.int8)
    worker = spec.get_worker(kv_caches_of(tensor))
    assert isinstance(worker, KvdOffloadingWorker) and worker.copy_mode == mode
    worker.reports_load_errors = True
    return spec.get_manager(), worker, tensor


class Gate:
    """Holds the copy thread at the start of every job (the worker's `_late`, which
    `submit_*` also asks, unheld) until opened."""

    def __init__(self, worker: KvdOffloadingWorker) -> None:
        self.open, self.entered = threading.Event(), threading.Event()
        self.late = worker._late

        def held(spec: Any) -> str | None:
            if threading.current_thread() is not threading.main_thread():  # not at submit
                self.entered.set()
                assert self.open.wait(30)
            return self.late(spec)

        worker._late = held  # type: ignore[method-assign]


def test_submit_returns_while_the_copy_waits_and_wait_names_its_jobs() -> None:
    with DaemonProcess() as d:
        manager, worker, tensor = plugin(d, "thread")
        tensor[1], tensor[2] = 3, 4
        first = manager.prepare_store([key(1)], ReqContext("a"))  # type: ignore[list-item]
        second = manager.prepare_store([key(2)], ReqContext("b"))  # type: ignore[list-item]
        assert first is not None and second is not None
        gate = Gate(worker)
        gate.late = lambda spec: None  # only the hold, no deadline
        assert worker.submit_store(1, device([1]), first.store_spec)  # returns: queued
        assert gate.entered.wait(10)
        assert worker.submit_store(2, device([2]), second.store_spec)
        assert worker.get_finished() == [] and worker.take_copies() == {}  # nothing done yet
        worker.wait({99})  # not a job: returns at once
        started = time.monotonic()
        threading.Timer(0.3, gate.open.set).start()
        worker.wait({1})
        assert time.monotonic() - started >= 0.25  # it waited for the copy
        assert finish(worker, 2) == {1: True, 2: True}
        assert set(worker.take_copies().values()) == {True}
        worker.shutdown()
        manager.shutdown()


def test_an_expedited_load_goes_before_the_queued_jobs() -> None:
    with DaemonProcess() as d:
        manager, worker, tensor = plugin(d, "thread")
        tensor[1] = 6
        out = manager.prepare_store([key(1)], ReqContext("w"))  # type: ignore[list-item]
        assert out is not None
        assert worker.submit_store(1, device([1]), out.store_spec)
        assert finish(worker, 1) == {1: True}
        manager.on_copies({t: (1, ok) for t, ok in worker.take_copies().items()})  # type: ignore[attr-defined]
        manager.complete_store([key(1)], ReqContext("w"))  # type: ignore[list-item]
        gate = Gate(worker)
        queued = [manager.prepare_store([key(i)], ReqContext(f"q{i}")) for i in (2, 3)]  # type: ignore[list-item]
        for job, out_ in zip((2, 3), queued, strict=True):
            assert out_ is not None and worker.submit_store(job, device([job]), out_.store_spec)
        assert gate.entered.wait(10)  # job 2 holds the thread; job 3 is queued
        load = manager.prepare_load([key(1)], ReqContext("w"))  # type: ignore[list-item]
        assert worker.submit_load(4, load, device([9]), expedited=True)
        gate.open.set()
        worker.wait({2, 3, 4})
        assert [r.job_id for r in worker.get_finished()] == [2, 4, 3]
        assert tensor[9].eq(6).all()
        worker.shutdown()
        manager.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_store_copy_is_reported_not_copied(mode: str) -> None:
    with DaemonProcess() as d:
        manager, worker, _ = plugin(d, mode)
        out = manager.prepare_store([key(1)], ReqContext("w"))  # type: ignore[list-item]
        assert out is not None
        assert worker.submit_store(1, device([10**6]), out.store_spec)  # no such block
        assert finish(worker, 1) == {1: True}  # vLLM asserts success
        assert worker.take_copies() == {out.store_spec.token: False}  # type: ignore[attr-defined]
        worker.shutdown()
        manager.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_a_load_past_its_deadline_when_its_copy_would_start_copies_nothing(mode: str) -> None:
    with DaemonProcess() as d:
        manager, worker, tensor = plugin(d, mode)
        tensor[1] = 8
        out = manager.prepare_store([key(1)], ReqContext("w"))  # type: ignore[list-item]
        assert out is not None and worker.submit_store(1, device([1]), out.store_spec)
        assert finish(worker, 1) == {1: True}
        manager.on_copies({t: (1, ok) for t, ok in worker.take_copies().items()})  # type: ignore[attr-defined]
        manager.complete_store([key(1)], ReqContext("w"))  # type: ignore[list-item]
        load = manager.prepare_load([key(1)], ReqContext("w"))  # type: ignore[list-item]
        if mode == "thread":  # on time at submit, late when the thread gets to it
            gate = Gate(worker)
            load.deadline = time.monotonic() + 0.2  # type: ignore[attr-defined]
            assert worker.submit_load(2, load, device([5]))
            assert gate.entered.wait(10)
            time.sleep(0.3)
            gate.open.set()
        else:
            load.deadline = time.monotonic() - 1  # type: ignore[attr-defined]
            assert worker.submit_load(2, load, device([5]))
        assert finish(worker, 2) == {2: True}
        assert worker.take_load_errors() == {5} and worker.take_failed_loads() == {2}
        assert not tensor[5].any()  # nothing copied
        worker.shutdown()
        manager.shutdown()


def test_a_job_keeps_its_segment_mapped_across_generation_changes() -> None:
    """Copies alone (no vLLM needed): a store holds generation 1's segment while
    generations 2..KEEP_SEGMENTS+1 push it out; its bytes land in generation 1's
    segment, which is unmapped once the job is done."""
    tensor = torch.arange(4 * 256, dtype=torch.int64).view(4, -1).to(torch.int8)
    copies = Copies([tensor], rank=0, replicated=False, mode="thread")
    names = [f"/kvd-test-{uuid.uuid4().hex[:12]}" for _ in range(KEEP_SEGMENTS + 1)]
    shms = [posix_ipc.SharedMemory(n, posix_ipc.O_CREX, size=8 * 256) for n in names]
    try:
        for gen, name in enumerate(names[:1], start=1):
            copies.map(p.Attached(0, name, gen, 8, 256, 256, 1, 256))
        opened, entered = threading.Event(), threading.Event()

        def hold() -> None:
            entered.set()
            assert opened.wait(30)

        plan = copies.plan(np.array([2]), [1], [0], np.array([5]))
        copies.submit(1, True, 1, plan, check=hold)  # type: ignore[arg-type]
        assert entered.wait(10)
        first = copies._segments[1]
        for gen, name in enumerate(names[1:], start=2):
            copies.map(p.Attached(0, name, gen, 8, 256, 256, 1, 256))
        assert 1 not in copies._segments and not first.mapping.mm.closed  # kept for the job
        opened.set()
        copies.wait({1})
        assert [(d.job_id, d.ok) for d in copies.poll()] == [(1, True)]
        assert first.mapping.mm.closed  # unmapped once done
        mm = __import__("mmap").mmap(shms[0].fd, 8 * 256)
        assert bytes(mm[5 * 256 : 6 * 256]) == tensor[2].numpy().tobytes()
        mm.close()
    finally:
        copies.close()
        for shm in shms:
            shm.close_fd()
            shm.unlink()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("chunk", "sizes", "starts", "slots"),
    [(1, [5], [0], [6, 0, 3, 7, 1]), (2, [3, 2], [1, 0], [2, 0, 5])],
)
def test_llama_shaped_canonical_tensors_round_trip(
    mode: str, chunk: int, sizes: list[int], starts: list[int], slots: list[int]
) -> None:
    """The CPU path of the copies tests/gpu/test_vllm_copies_cuda.py runs on CUDA, on
    tensors shaped as vLLM's canonical caches (32 layers of 64 KiB pages)."""
    layers, page, blocks = 32, 2 * 8 * 128 * 16 * 2, 16
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randint(-128, 127, (blocks, page), dtype=torch.int8, generator=gen)
               for _ in range(layers)]  # fmt: skip
    slot = layers * page * chunk
    name = f"/kvd-test-{uuid.uuid4().hex[:12]}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=8 * slot)
    copies = Copies(tensors, rank=0, replicated=False, blocks_per_chunk=chunk,
                    num_groups=len(sizes), mode=mode)  # fmt: skip
    try:
        copies.map(p.Attached(0, name, 1, 8, slot, slot, 1, slot))
        dev, back = np.array([1, 4, 6, 9, 12]), np.array([2, 3, 5, 7, 8])
        want = [t[dev].clone() for t in tensors]
        for job, store, ids in ((1, True, dev), (2, False, back)):
            if not store:
                for t in tensors:
                    t[back] = 0
            copies.submit(job, store, 1, copies.plan(ids, sizes, starts, np.array(slots)))
            copies.wait({job})
            assert [(d.job_id, d.ok) for d in copies.poll()] == [(job, True)]
        assert all(torch.equal(t[back], w) for t, w in zip(tensors, want, strict=True))
    finally:
        copies.close()
        shm.close_fd()
        shm.unlink()
