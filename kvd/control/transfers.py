"""Runs in the daemon: transfer jobs from prepare to settle (SPEC section 5).

`Transfers` is the one owner of every `Store` and `Load` job: it prepares the
slots under the job's owner token, records the job in the core's `JobTable`,
pushes one `TransferJob` per rank, takes the ranks' `JobDone`, and applies
what the state machine decides:

    report  the scheduler's `Finished` gets the job's `JobResult`
    settle  the pool's index completes the store (or releases the pins)

Deadlines, a rank that goes away, and pool drop, reset or shutdown all end
in the same two steps, so there is one path from a job to its slots. A job
answers to the sessions it was pushed to (`kvd.core.jobs` says when it
settles); a store or load whose push fails is rolled back in the index.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence

from kvd.control.pools import Pool, PoolRegistry
from kvd.control.sessions import Session, SessionTable
from kvd.core.jobs import Job, JobTable, Outcome, job_owner
from kvd.errors import BadRequest, KvdError, WorkersMissing
from kvd_client import protocol as p
from kvd_client.errors import ErrorCode
from kvd_client.types import JobKind

log = logging.getLogger("kvd.control.transfers")
Outbox = list[tuple[bytes, bytes]]
MAX_COUNTER = (1 << 63) - 1


def check_lengths(keys: Sequence[bytes], ids: Sequence[int]) -> None:
    # Key and id bounds are checked by the schema while decoding; this is not.
    if len(ids) != len(keys):
        raise BadRequest(f"{len(keys)} keys but {len(ids)} device block ids")


def job_result(job: Job) -> p.JobResult:
    return p.JobResult(job.job_id, job.ok, job.nbytes, job.seconds, job.failure)


class Transfers:
    def __init__(
        self,
        timeout_s: float,
        pools: PoolRegistry,
        sessions: SessionTable,
        counters: Counter[str],
        outbox: Outbox,
        encode: Callable[[p.Reply], bytes],
        max_results: int = 65_536,
        first_job_id: int = 1,
    ) -> None:
        self.jobs = JobTable(timeout_s, first_job_id)
        # Results a scheduler has not collected with `Finished`; past this the
        # oldest are dropped and counted (`results_dropped`).
        self._max_results = max_results
        self._pools = pools
        self._sessions = sessions
        self._counters = counters
        self._outbox = outbox
        self._encode = encode
        self._results: dict[int, list[p.JobResult]] = {}  # by scheduler session

    def __len__(self) -> int:
        return len(self.jobs)

    # -- starting jobs ---------------------------------------------------------

    def store(
        self, s: Session, pool: Pool, req_id: int, keys: list[bytes], device_ids: list[int],
        now: float,
    ) -> p.Reply:  # fmt: skip
        check_lengths(keys, device_ids)
        ranks = self._ranks(s, pool)
        job_id = self.jobs.new_id()
        out = pool.owned.prepare_store(job_owner(job_id), keys)
        if out is None:
            self._counters["stores_rejected"] += 1
            return p.StoreTicket(req_id, False)
        if not out.keys_to_store:
            return p.StoreTicket(req_id, True, None, [], out.evicted_keys)
        device_of = dict(zip(keys, device_ids, strict=True))
        job_device_ids = [device_of[k] for k in out.keys_to_store]
        writers = frozenset({0}) if pool.layout.replicated else frozenset(ranks)
        self._start(
            "store", s, pool, ranks, job_id, out.keys_to_store, out.store_spec.slots,
            job_device_ids, writers, now,
        )  # fmt: skip
        self._counters["stores"] += 1
        return p.StoreTicket(req_id, True, job_id, out.keys_to_store, out.evicted_keys)

    def load(
        self, s: Session, pool: Pool, req_id: int, keys: list[bytes], device_ids: list[int],
        now: float,
    ) -> p.Reply:  # fmt: skip
        check_lengths(keys, device_ids)
        ranks = self._ranks(s, pool)
        job_id = self.jobs.new_id()
        spec = pool.owned.prepare_load(job_owner(job_id), keys, account=s.session_id)
        self._start(
            "load", s, pool, ranks, job_id, list(keys), spec.slots, list(device_ids),
            frozenset(ranks), now,
        )  # fmt: skip
        self._counters["loads"] += 1
        self._counters["loaded_blocks"] += len(keys)
        return p.LoadTicket(req_id, job_id)

    def _ranks(self, s: Session, pool: Pool) -> dict[int, Session]:
        # A worker still on a dropped generation of the pool cannot copy for this one.
        ranks = {
            rank: w
            for rank, w in self._sessions.workers(pool.name, s.engine_id).items()
            if w.generation == pool.generation
        }
        missing = [r for r in range(pool.layout.world_size) if r not in ranks]
        if missing:
            raise WorkersMissing(
                f"engine {s.engine_id!r} has no worker registered on pool "
                f"{pool.name!r} for rank(s) {missing}"
            )
        return ranks

    def _start(
        self,
        kind: JobKind,
        s: Session,
        pool: Pool,
        ranks: dict[int, Session],
        job_id: int,
        keys: list[bytes],
        slots: list[int],
        device_ids: list[int],
        writers: frozenset[int],
        now: float,
    ) -> None:
        """Records the job and pushes one `TransferJob` to each rank of the engine.

        If that fails, the slots prepared for the job are given back.
        """
        try:
            deadline = self.jobs.deadline_of(now)
            frames = [
                (worker.identity, self._encode(p.TransferJob(
                    0, job_id, kind, pool.name, pool.generation, device_ids, slots,
                    rank in writers, deadline,
                )))
                for rank, worker in ranks.items()
            ]  # fmt: skip
            self.jobs.create(
                job_id=job_id,
                kind=kind,
                pool=pool.name,
                generation=pool.generation,
                session_id=s.session_id,
                engine_id=s.engine_id,
                keys=keys,
                slots=slots,
                device_block_ids=device_ids,
                pushed_to={rank: w.session_id for rank, w in ranks.items()},
                writers=writers,
                now=now,
            )
        except Exception:
            pool.owned.release(job_owner(job_id))
            raise
        self._outbox.extend(frames)

    # -- acknowledgements and ends ---------------------------------------------

    def job_done(self, s: Session, req: p.JobDone) -> p.Reply:
        if s.role != "worker":
            raise KvdError("only a worker may send JobDone", ErrorCode.WRONG_ROLE)
        if req.rank != s.rank:
            raise KvdError(f"this session is rank {s.rank}, not {req.rank}", ErrorCode.NOT_OWNER)
        job = self.jobs.get(req.job_id)
        if job is not None and job.engine_id != s.engine_id:
            raise KvdError(f"job {req.job_id} belongs to another engine", ErrorCode.NOT_OWNER)
        outcome = self.jobs.ack(
            req.job_id, s.session_id, req.rank, req.ok, req.nbytes, req.seconds, req.detail
        )
        if outcome is not None:
            self._apply([outcome])
            if req.ok:  # saturates: a counter must stay encodable
                name = "bytes_stored" if outcome.job.kind == "store" else "bytes_loaded"
                self._counters[name] = min(self._counters[name] + req.nbytes, MAX_COUNTER)
        return p.Ok(req.req_id)

    def expire(self, now: float) -> None:
        """Fails jobs past their deadline; settles those past their hard deadline."""
        self._apply(self.jobs.expire(now))

    def session_gone(
        self, session_id: int, stopped: bool, now: float = 0.0, grace_s: float = 0.0
    ) -> None:
        """A worker session ended: the jobs it owes fail (`JobTable.session_gone`)."""
        self._apply(self.jobs.session_gone(session_id, stopped, now, grace_s))

    def rebind(self, old: int, new: Session) -> None:
        """`new` is a reconnect of the worker process behind `old`: it inherits its jobs,
        and gets each one pushed again (a push to the old socket may never have
        arrived; the worker ignores a job it already has)."""
        moved = self.jobs.rebind(old, new.session_id)
        for job, rank in moved:
            msg = p.TransferJob(
                0, job.job_id, job.kind, job.pool, job.generation, job.device_block_ids,
                job.slots, rank in job.writers, job.deadline,
            )  # fmt: skip
            self._outbox.append((new.identity, self._encode(msg)))
        if moved:
            log.info(
                "event=jobs_rebound engine=%s rank=%d old_session=%d session=%d jobs=%d",
                new.engine_id,
                new.rank,
                old,
                new.session_id,
                len(moved),
            )

    def fail_all(self, reason: str, pool: str | None = None) -> None:
        """Pool drop (`pool`) or shutdown (every pool): jobs fail and settle now."""
        self._apply(self.jobs.fail_all(reason, pool=pool))

    def fail_pool(self, pool: str, reason: str) -> None:
        """Pool reset: the pool's jobs fail now and settle when their ranks are done."""
        self._apply(self.jobs.fail_pool(pool, reason))

    def num_unsettled(self, pool: str) -> int:
        return self.jobs.num_unsettled(pool)

    def take_results(self, session_id: int) -> list[p.JobResult]:
        return self._results.pop(session_id, [])

    def forget_session(self, session_id: int) -> None:
        self._results.pop(session_id, None)

    def _apply(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            job = o.job
            if o.report:
                self._report(job)
            if o.settle:
                self._settle(job)

    def _report(self, job: Job) -> None:
        if self._sessions.by_id(job.session_id) is not None:
            results = self._results.setdefault(job.session_id, [])
            if len(results) >= self._max_results:
                keep = self._max_results // 2  # amortized: not one shift per result
                self._counters["results_dropped"] += len(results) - keep
                del results[: len(results) - keep]
            results.append(job_result(job))
        if not job.ok:
            self._counters[f"jobs_failed.{job.kind}"] += 1
            log.warning(
                "event=job_failed job=%d kind=%s pool=%s reason=%r",
                job.job_id,
                job.kind,
                job.pool,
                job.failure,
            )

    def _settle(self, job: Job) -> None:
        pool = self._pools.find(job.pool)
        if pool is None or pool.generation != job.generation:
            return  # the pool went, and its index with it
        if job.kind == "store":
            pool.owned.complete_store(job.owner, job.keys, success=job.ok)
        else:
            pool.owned.complete_load(job.owner, job.keys)
