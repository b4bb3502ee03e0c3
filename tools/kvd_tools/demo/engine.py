"""Runs in the demo's scheduler process: a tiny inference engine that caches prefixes in kvd.

`Engine` owns the kvd `Scheduler` session, the device block allocator and
the TP worker processes. One request at a time (`generate`):

1. hash the prompt's full blocks, `lookup` the longest cached prefix (at most
   up to the second-to-last token: the last one is always computed, for its
   logits), allocate device blocks, `load` the hits;
2. `Forward` to every rank: each waits for the load, then prefills only the
   uncached suffix, attending over loaded + new KV; rank 0 returns logits
   (time to first token ends here);
3. `store` the prompt's new full blocks; the job id rides on the next step,
   so the copy runs after the pass that wrote them; greedy decode steps;
4. `Release`: the workers finish the store; the device blocks are freed only
   once the daemon reports the store done.

With `use_kvd=False` the same request runs without lookup, load or store:
the recompute that TTFT and logits are compared against. The engine keeps
no prefix cache of its own on the device (a real one would, in front of
kvd): every reused block here comes from kvd.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvd_client.errors import KvdError
from kvd_client.protocol import JobResult, Layout
from kvd_client.scheduler import Scheduler
from kvd_tools.demo.block_manager import BlockAllocator, block_hashes, blocks_for, root_hash
from kvd_tools.demo.model import ModelConfig, slot_bytes
from kvd_tools.demo.step import (
    Answer,
    Command,
    Failed,
    Forward,
    Output,
    Ready,
    Release,
    Released,
    Shutdown,
    WorkerSpec,
)
from kvd_tools.demo.tp_worker import worker_main
from kvd_tools.harness import RankExited, RankProcess, RankSilent, close_ranks

log = logging.getLogger("kvd_tools.demo")
STEP_TIMEOUT_S = 600.0  # an 8k-token prefill on a busy 2-core host takes seconds
START_TIMEOUT_S = 120.0


class EngineError(Exception):
    """A worker failed or stopped answering; the engine cannot go on."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    endpoint: str
    pool: str
    pool_bytes: int
    num_device_blocks: int
    world_size: int = 2

    @classmethod
    def sized(
        cls, config: ModelConfig, endpoint: str, pool: str, *, max_tokens: int, pool_bytes: int
    ) -> EngineConfig:
        """A config whose device KV cache holds one request of `max_tokens` tokens."""
        num_device_blocks = blocks_for(max_tokens, config.block_tokens) + 1
        return cls(config, endpoint, pool, pool_bytes, num_device_blocks)

    def layout(self) -> Layout:
        mla = self.model.variant == "mla"
        return Layout(
            model=self.model.identity,
            dtype="float32",
            block_tokens=self.model.block_tokens,
            world_size=self.world_size,
            replicated=mla,
            slot_bytes=slot_bytes(self.model, self.world_size),
            extra="demo-cache-v1",
        )


@dataclass(frozen=True, slots=True)
class Generation:
    """One request's outcome; `logits` are the first generated token's."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    logits: npt.NDArray[np.float32]
    tokens: list[int]
    load_bytes: int
    store_bytes: int


class Engine:
    def __init__(self, config: EngineConfig, engine_id: str) -> None:
        self.config = config
        self.block_tokens = config.model.block_tokens
        self.allocator = BlockAllocator(config.num_device_blocks)
        self._results: dict[int, JobResult] = {}
        self._ranks: list[RankProcess] = []
        self._rendezvous = Path(tempfile.mkdtemp(prefix="kvd-demo-"))
        # The scheduler attaches first: its Attach creates the pool with our capacity.
        self.kvd = Scheduler(
            config.pool,
            config.layout(),
            engine_id=engine_id,
            endpoint=config.endpoint,
            capacity_bytes=config.pool_bytes,
            timeout_ms=5000,
        )
        try:
            self._start_workers(engine_id)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, engine_id: str) -> None:
        c = self.config
        spec = WorkerSpec(
            config=c.model,
            world_size=c.world_size,
            num_device_blocks=c.num_device_blocks,
            pool=c.pool,
            layout=c.layout(),
            engine_id=engine_id,
            endpoint=c.endpoint,
            init_method=f"file://{self._rendezvous / 'pg'}",
        )
        for rank in range(c.world_size):
            self._ranks.append(RankProcess(rank, worker_main, (spec,)))
        for answer in self._gather(START_TIMEOUT_S):
            if not isinstance(answer, Ready):
                raise EngineError(f"unexpected answer at start: {answer}")
            if not answer.connected:
                log.warning("rank %d has no kvd session yet; requests recompute", answer.rank)

    # -- the per-step channel --------------------------------------------------

    def _broadcast(self, command: Command) -> None:
        for rank in self._ranks:
            rank.send(command)

    def _gather(self, timeout_s: float = STEP_TIMEOUT_S) -> list[Answer]:
        answers: list[Answer] = []
        for rank in self._ranks:
            try:
                answer = rank.receive(timeout_s)
            except (RankSilent, RankExited) as exc:
                raise EngineError(str(exc)) from None
            if isinstance(answer, Failed):
                raise EngineError(f"rank {answer.rank} failed:\n{answer.error}")
            answers.append(answer)
        return answers

    def _forward(self, step: Forward) -> tuple[npt.NDArray[np.float32], int]:
        """Rank 0's logits and the position the ranks started at (0 after a failed load)."""
        first = self._gather_after(step)[0]
        if not isinstance(first, Output) or first.logits is None:
            raise EngineError(f"rank 0 answered {first}")
        return first.logits, first.start

    def _gather_after(self, command: Command) -> list[Answer]:
        self._broadcast(command)
        return self._gather()

    # -- kvd jobs --------------------------------------------------------------

    def _job_result(self, job_id: int, timeout_s: float = 30.0) -> JobResult:
        """The daemon's result for `job_id` (failed when it never comes)."""
        deadline = time.monotonic() + timeout_s
        while job_id not in self._results and time.monotonic() < deadline:
            for r in self.kvd.finished():
                self._results[r.job_id] = r
            if job_id not in self._results:
                time.sleep(0.002)
        result = self._results.pop(job_id, JobResult(job_id, False, 0, 0.0, "no result"))
        if not result.ok:
            log.warning("kvd job %d failed: %s", job_id, result.detail or "no detail")
        return result

    def _lookup_and_load(self, keys: list[bytes], table: list[int]) -> tuple[int, int | None]:
        """Cached blocks and the load job that brings them in (hits, job id)."""
        try:
            hits = self.kvd.lookup(keys) or 0  # None: a store in flight; recompute meanwhile
            if hits == 0:
                return 0, None
            job = self.kvd.load(keys[:hits], table[:hits])
        except KvdError as exc:
            log.warning("lookup or load refused (%s); recomputing", exc)
            return 0, None  # evicted or unreachable since the lookup: recompute
        self.kvd.touch(keys[:hits])
        return hits, job

    # -- requests --------------------------------------------------------------

    def generate(
        self, prompt: list[int], *, use_kvd: bool = True, gen_tokens: int = 1, salt: bytes = b""
    ) -> Generation:
        """Prefills `prompt`, then decodes greedily up to `gen_tokens` tokens in all."""
        t0 = time.perf_counter()
        bt, n = self.block_tokens, len(prompt)
        table = self.allocator.allocate(blocks_for(n + gen_tokens, bt))
        if table is None:
            raise EngineError(f"{n + gen_tokens} tokens do not fit the device KV cache")
        keys: list[bytes] = []
        load_job: int | None = None
        hits = 0
        if use_kvd:
            keys = block_hashes(prompt, bt, root_hash(self.config.model.identity, salt))
            hits, load_job = self._lookup_and_load(keys[: (n - 1) // bt], table)
        first_logits, cached = self._forward(Forward(prompt, hits * bt, table, load_job))
        ttft = time.perf_counter() - t0
        store_job: int | None = None  # the store's id, kept for its result
        if use_kvd:
            # Blocks from `computed` on were written by this pass (all of them
            # after a failed load): store the full ones; the daemon skips any
            # it holds already.
            computed = cached // bt
            new_keys = keys[computed:]
            if new_keys:
                try:
                    ticket = self.kvd.store(new_keys, table[computed : len(keys)])
                except KvdError as exc:
                    log.warning("store refused (%s); not caching this prompt", exc)
                    ticket = None
                if ticket is None:
                    log.warning("store of %d blocks did not fit, or kvd is away", len(new_keys))
                store_job = None if ticket is None else ticket.job_id
        unsent = store_job  # rides on the next step, once
        tokens = [int(np.argmax(first_logits))]
        while len(tokens) < gen_tokens:
            seq = prompt + tokens
            step = Forward(seq, len(seq) - 1, table, store_job=unsent)
            unsent = None
            tokens.append(int(np.argmax(self._forward(step)[0])))
        for answer in self._gather_after(Release(unsent)):
            if not isinstance(answer, Released):
                raise EngineError(f"unexpected answer to Release: {answer}")
        load_bytes = 0 if load_job is None else self._job_result(load_job).nbytes
        # Reusing the device blocks before the daemon has the store's copies
        # would let the next request overwrite what is being stored.
        store_bytes = 0 if store_job is None else self._job_result(store_job).nbytes
        self.allocator.free(table)
        return Generation(
            n, cached, ttft, time.perf_counter() - t0, first_logits, tokens, load_bytes, store_bytes
        )

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Stops the workers (killing any that do not exit) and ends the kvd session."""
        close_ranks(self._ranks, Shutdown())
        self._ranks = []
        self.kvd.close()
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
