"""Runs in the daemon (pure core): the transfer-job state machine (SPEC section 5).

A job is one `Store` or `Load` of one scheduler, copied by every rank of its
engine. Two moments matter and they differ:

    reported  the scheduler learns ok/failed: every rank acknowledged ok, or
              the first rank failed, or the job passed its deadline;
    settled   no rank can touch the job's slots any more: every rank has
              acknowledged, or said goodbye after its copies stopped, or the
              hard deadline passed. Only now does the daemon complete the
              store (or release the load pins), so a late writer can never
              scribble over a reused slot.

A job is pushed to one session per rank and only that session may answer for
that rank (`pushed_to`). A session that ends without saying its copies
stopped (its lease expired, another process took its rank) fails the job at
once, but that rank counts as gone only a grace later (one lease, and not
before the job's deadline): its process may still be copying, and may still
start the job until its deadline. A worker never
launches a job past its deadline (it travels in `TransferJob`). A new
session of the same worker process (a reconnect) inherits the old one's
jobs (`rebind`).

Time is passed in by the caller (`now`, seconds); nothing here reads a clock.
What the scheduler is told, and what the index is told, is the caller's
(`kvd.control.transfers`): this module only says when.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.core.index import Key
from kvd.errors import BadRequest, KvdError
from kvd_client.errors import ErrorCode
from kvd_client.types import JobKind

JobOwner = tuple[str, int]


def job_owner(job_id: int) -> JobOwner:
    """The owner token of a job's stores and pins in its pool's `OwnedIndex`.

    Needed before the job exists (the store is prepared first), so it is a
    function of the id; `Job.owner` is the same token.
    """
    return ("job", job_id)


@dataclass
class Job:
    job_id: int
    kind: JobKind
    pool: str
    generation: int
    session_id: int
    engine_id: str
    keys: list[Key]
    slots: list[int]
    device_block_ids: list[int]
    pushed_to: dict[int, int]  # rank -> the session the job was sent to
    writers: frozenset[int]
    deadline: float
    hard_deadline: float
    acked: dict[int, bool] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    gone_at: dict[int, float] = field(default_factory=dict)  # rank -> when it counts as gone
    nbytes: int = 0
    seconds: float = 0.0
    failure: str = ""
    reported: bool = False
    settled: bool = False

    @property
    def owner(self) -> JobOwner:
        return job_owner(self.job_id)

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(self.pushed_to)

    @property
    def pending(self) -> frozenset[int]:
        return self.ranks - self.acked.keys() - self.gone

    @property
    def ok(self) -> bool:
        return not self.failure and all(self.acked.get(r, False) for r in self.ranks)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the daemon must do for a job after a transition."""

    job: Job
    report: bool  # tell the scheduler how the job ended, now
    settle: bool  # complete the store / release the pins in the index now


class JobTable:
    def __init__(self, timeout_s: float, first_id: int = 1) -> None:
        """`first_id`: where job ids start; the daemon starts from its start time in
        microseconds, so ids never repeat across restarts (a worker may remember
        ids of the earlier run)."""
        self.timeout_s = timeout_s
        self._jobs: dict[int, Job] = {}
        self._next_id = first_id

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, job_id: int) -> Job | None:
        return self._jobs.get(job_id)

    def deadline_of(self, now: float) -> float:
        """The deadline of a job created at `now` (its hard deadline is one timeout later)."""
        return now + self.timeout_s

    def new_id(self) -> int:
        """Reserves the id of the next job (its owner token is needed before `create`)."""
        job_id = self._next_id
        self._next_id += 1
        return job_id

    def create(
        self,
        *,
        job_id: int,
        kind: JobKind,
        pool: str,
        generation: int,
        session_id: int,
        engine_id: str,
        keys: list[Key],
        slots: list[int],
        device_block_ids: list[int],
        pushed_to: dict[int, int],
        writers: frozenset[int],
        now: float,
    ) -> Job:
        if not pushed_to:
            raise BadRequest("a job needs at least one rank")
        job = Job(
            job_id=job_id,
            kind=kind,
            pool=pool,
            generation=generation,
            session_id=session_id,
            engine_id=engine_id,
            keys=keys,
            slots=slots,
            device_block_ids=device_block_ids,
            pushed_to=dict(pushed_to),
            writers=writers,
            deadline=self.deadline_of(now),
            hard_deadline=self.deadline_of(now) + self.timeout_s,
        )
        self._jobs[job.job_id] = job
        return job

    def ack(
        self,
        job_id: int,
        session_id: int,
        rank: int,
        ok: bool,
        nbytes: int,
        seconds: float,
        detail: str = "",
    ) -> Outcome | None:
        """Records one rank's acknowledgement from `session_id`. `None` for a job
        already settled and forgotten (a late ack after a hard deadline); an ack
        from a session the job was not sent to is `NOT_OWNER`."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if rank not in job.pushed_to:
            raise KvdError(f"job {job_id} was not sent to rank {rank}", ErrorCode.NOT_OWNER)
        if job.pushed_to[rank] != session_id:
            raise KvdError(
                f"job {job_id} was sent to another session of rank {rank}", ErrorCode.NOT_OWNER
            )
        if rank in job.acked:
            raise BadRequest(f"rank {rank} already acknowledged job {job_id}")
        job.acked[rank] = ok
        job.gone.discard(rank)
        job.gone_at.pop(rank, None)
        job.nbytes += max(0, nbytes)
        job.seconds = max(job.seconds, seconds)
        if not ok and not job.failure:
            job.failure = f"rank {rank} failed" + (f": {detail}" if detail else "")
        return self._advance(job)

    def session_gone(
        self, session_id: int, stopped: bool, now: float = 0.0, grace_s: float = 0.0
    ) -> list[Outcome]:
        """A worker session ended: the jobs it still owes fail now. Its ranks count
        as gone now if `stopped` (it said goodbye after its copies ended), else
        `grace_s` from `now` (its process may still be copying)."""
        outcomes = []
        for job in list(self._jobs.values()):
            owed = [r for r in job.pending if job.pushed_to[r] == session_id]
            if not owed:
                continue
            if stopped:
                job.gone.update(owed)
            else:
                # It may still start the job until its deadline (a worker never
                # starts one later), and copy for a grace after it stopped talking.
                for rank in owed:
                    job.gone_at[rank] = max(now + grace_s, job.deadline)
            if not job.failure:
                job.failure = f"rank {owed[0]} went away"
            outcomes.append(self._advance(job))
        return outcomes

    def rebind(self, old_session: int, new_session: int) -> list[tuple[Job, int]]:
        """A worker process reconnected: its new session answers for the old one's
        jobs. Returns the (job, rank) pairs still waiting for that rank."""
        moved = []
        for job in self._jobs.values():
            for rank, sid in job.pushed_to.items():
                if sid == old_session:
                    job.pushed_to[rank] = new_session
                    job.gone_at.pop(rank, None)
                    if rank in job.pending:
                        moved.append((job, rank))
        return moved

    def expire(self, now: float) -> list[Outcome]:
        """Fails jobs past their deadline; settles jobs past their hard deadline."""
        outcomes = []
        for job in list(self._jobs.values()):
            due = [r for r, at in job.gone_at.items() if at <= now and r in job.pending]
            if due:
                job.gone.update(due)
                for rank in due:
                    del job.gone_at[rank]
                outcomes.append(self._advance(job))
                if job.settled:
                    continue
            if now >= job.hard_deadline:
                job.gone |= job.pending
                if not job.failure:
                    job.failure = "timed out"
                outcomes.append(self._advance(job))
            elif now >= job.deadline and not job.reported:
                job.failure = job.failure or f"timed out after {self.timeout_s:g} s"
                outcomes.append(self._advance(job))
        return outcomes

    def fail_all(self, reason: str, pool: str | None = None) -> list[Outcome]:
        """Shutdown or pool drop: every job (of `pool`) fails and settles now; the
        caller makes sure nothing reuses its slots (the segment goes away)."""
        outcomes = []
        for job in list(self._jobs.values()):
            if pool is not None and job.pool != pool:
                continue
            job.gone |= job.pending
            job.failure = job.failure or reason
            outcomes.append(self._advance(job))
        return outcomes

    def fail_pool(self, pool: str, reason: str) -> list[Outcome]:
        """Pool reset: the pool's jobs fail now and settle as any job does (every
        rank answered, or the hard deadline), so no slot is reused under a copy."""
        outcomes = []
        for job in list(self._jobs.values()):
            if job.pool == pool and not job.failure:
                job.failure = reason
                outcomes.append(self._advance(job))
        return outcomes

    def num_unsettled(self, pool: str) -> int:
        return sum(1 for job in self._jobs.values() if job.pool == pool)

    def _advance(self, job: Job) -> Outcome:
        report = False
        if not job.reported and (job.failure or not job.pending):
            job.reported = report = True
        settle = False
        if not job.settled and not job.pending:
            job.settled = settle = True
            del self._jobs[job.job_id]
        return Outcome(job, report, settle)
