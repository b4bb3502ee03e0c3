"""Runs in a demo TP worker: one rank's model shard, paged KV cache and `kvd_client.Worker`.

Started by the engine (spawn), one per rank. It joins the other ranks in a
gloo process group, builds its model shard and KV cache, attaches the cache
to the kvd pool, then serves `kvd_tools.demo.step` commands from its pipe until
`Shutdown` or until the pipe closes (the engine died: exit, never linger).
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kvd_client.worker import Worker
from kvd_tools.demo.model import ShardedModel
from kvd_tools.demo.step import (
    Failed,
    Forward,
    Output,
    Ready,
    Release,
    Released,
    Shutdown,
    WorkerSpec,
)
from kvd_tools.harness import commands

JOB_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 20.0


def _all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t)


class TPWorker:
    """The state of one rank between steps."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        self.rank = rank
        self.model = ShardedModel(spec.config, rank, spec.world_size, _all_reduce)
        self.cache = self.model.make_cache(spec.num_device_blocks)
        self._warm_up()
        self.kvd = Worker(
            rank,
            spec.world_size,
            self.cache,
            pool=spec.pool,
            layout=spec.layout,
            engine_id=spec.engine_id,
            endpoint=spec.endpoint,
        )

    def _warm_up(self) -> None:
        """Runs each code path once (full prefill, suffix, decode) before the first request.

        The first pass through torch's kernels pays for their lazy set-up; better
        here than in a request's TTFT. The KV it writes lands in blocks that every
        request overwrites (by a load or its own pass) before reading them.
        """
        bt = self.model.config.block_tokens
        if self.cache.shape[0] < 2:
            return
        table = torch.arange(2)
        tokens = torch.zeros(2 * bt, dtype=torch.int64)
        self.model.forward(tokens[: 2 * bt], 0, table, self.cache)
        self.model.forward(tokens[bt : 2 * bt], bt, table, self.cache)
        self.model.forward(tokens[:1], bt, table, self.cache)

    def _wait(self, job_id: int) -> bool:
        return self.kvd.wait([job_id], timeout_s=JOB_TIMEOUT_S).get(job_id, False)

    def forward(self, step: Forward) -> Output:
        if step.store_job is not None:
            # The blocks it reads were written by an earlier pass; this pass
            # writes later positions only, so the order between them is free.
            self._wait(step.store_job)
        start, load_ok = step.start, None
        if step.load_job is not None:
            ok = self._wait(step.load_job)
            # Every rank must take the same path, or the all-reduces mismatch:
            # one failed load makes all ranks recompute from position 0.
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            load_ok = bool(flag.item())
            if not load_ok:
                start = 0
        tokens = torch.tensor(step.tokens[start:], dtype=torch.int64)
        table = torch.tensor(step.block_table, dtype=torch.int64)
        logits = self.model.forward(tokens, start, table, self.cache)
        return Output(self.rank, logits.numpy() if self.rank == 0 else None, start, load_ok)

    def release(self, step: Release) -> Released:
        ok = None if step.store_job is None else self._wait(step.store_job)
        return Released(self.rank, ok)

    def close(self) -> None:
        self.kvd.close()


def worker_main(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """The process entry point (spawned by `kvd_tools.demo.engine.Engine`)."""
    # One thread per rank: the TP ranks share the host's cores between them.
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(message)s")
    worker: TPWorker | None = None
    try:
        dist.init_process_group(
            "gloo", init_method=spec.init_method, rank=rank, world_size=spec.world_size
        )
        worker = TPWorker(rank, spec)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while not worker.kvd.connected and time.monotonic() < deadline:
            time.sleep(0.05)  # the first connect timed out; the keeper retries
        conn.send(Ready(rank, worker.kvd.connected))
        for command in commands(conn):  # ends when the engine is gone
            match command:
                case Forward() as step:
                    conn.send(worker.forward(step))
                case Release() as step:
                    conn.send(worker.release(step))
                case Shutdown():
                    return
    except Exception:
        # Report to the engine instead of dying silently; it tears the rest down.
        with contextlib.suppress(OSError):
            conn.send(Failed(rank, traceback.format_exc()))
    finally:
        if worker is not None:
            worker.close()
        if dist.is_initialized():
            dist.destroy_process_group()
