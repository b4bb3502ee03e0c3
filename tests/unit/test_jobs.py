"""Runs in the test process: the transfer-job state machine, no sockets."""

from __future__ import annotations

import pytest

from kvd.core.jobs import Job, JobTable
from kvd.errors import KvdError


def session(rank: int) -> int:
    """The session id a test job of rank `rank` was pushed to."""
    return 100 + rank


def make(table: JobTable, ranks: int = 2, now: float = 0.0, kind: str = "store") -> Job:
    return table.create(
        job_id=table.new_id(),
        kind=kind,
        pool="p",
        generation=1,
        session_id=7,  # type: ignore[arg-type]
        engine_id="e",
        keys=[b"a"],
        slots=[0],
        device_block_ids=[3],
        pushed_to={r: session(r) for r in range(ranks)},
        writers=frozenset({0}),
        now=now,
    )


def test_reported_and_settled_only_when_every_rank_acked() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    o = t.ack(job.job_id, session(0), 0, True, 100, 0.1)
    assert o is not None and not o.report and not o.settle
    o = t.ack(job.job_id, session(1), 1, True, 0, 0.2)
    assert o is not None and o.report and o.settle and o.job.ok
    assert o.job.nbytes == 100 and o.job.seconds == 0.2
    assert len(t) == 0


def test_failed_rank_reports_at_once_but_settles_after_the_others() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t, ranks=3)
    o = t.ack(job.job_id, session(1), 1, False, 0, 0.0, "boom")
    assert o is not None and o.report and not o.settle and not o.job.ok
    assert "rank 1 failed: boom" in o.job.failure
    o = t.ack(job.job_id, session(0), 0, True, 10, 0.0)
    assert o is not None and not o.report and not o.settle
    (o,) = t.session_gone(session(2), stopped=True)
    assert not o.report and o.settle and not o.job.ok


def test_timeout_reports_then_hard_deadline_settles() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t, now=10.0)
    assert t.expire(10.5) == []
    (o,) = t.expire(11.0)
    assert o.report and not o.settle and "timed out" in o.job.failure
    assert t.expire(11.5) == []
    (o,) = t.expire(12.0)
    assert o.settle and not o.report
    assert t.get(job.job_id) is None
    assert t.ack(job.job_id, session(0), 0, True, 0, 0.0) is None  # late ack of a forgotten job


def test_ack_misuse_raises() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    with pytest.raises(KvdError):
        t.ack(job.job_id, session(5), 5, True, 0, 0.0)
    t.ack(job.job_id, session(0), 0, True, 0, 0.0)
    with pytest.raises(KvdError):
        t.ack(job.job_id, session(0), 0, True, 0, 0.0)


def test_fail_all_by_pool() -> None:
    t = JobTable(timeout_s=1.0)
    a = make(t)
    outcomes = t.fail_all("drop", pool="other")
    assert outcomes == []
    (o,) = t.fail_all("drop", pool="p")
    assert o.job is a and o.report and o.settle and o.job.failure == "drop"
    assert len(t) == 0


# -- a job answers to the sessions it was pushed to (failure rules, finding 1) ---


def test_an_ack_from_another_session_of_the_rank_is_refused() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    with pytest.raises(KvdError) as err:
        t.ack(job.job_id, 999, 1, True, 0, 0.0)  # rank 1, but not the session it went to
    assert err.value.code == "NOT_OWNER"
    assert job.acked == {} and t.get(job.job_id) is job


def test_a_session_that_owes_nothing_leaves_jobs_alone() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    assert t.session_gone(999, stopped=True) == []  # same engine and rank, another pool
    assert not job.failure and job.pending == {0, 1}


def test_a_session_gone_without_stopping_fails_now_and_settles_a_grace_later() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t, now=10.0)  # deadline 11.0, hard deadline 12.0
    (o,) = t.session_gone(session(1), stopped=False, now=10.6, grace_s=0.8)  # lease expired
    assert o.report and not o.settle and "went away" in job.failure
    assert t.ack(job.job_id, session(0), 0, True, 0, 0.0) is not None
    assert t.get(job.job_id) is job  # rank 1 may still be writing
    assert t.expire(11.3) == []
    (o,) = t.expire(11.4)  # one grace after it went
    assert o.settle and not o.report and t.get(job.job_id) is None


def test_a_gone_session_counts_gone_no_earlier_than_the_jobs_deadline() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t, now=10.0)  # deadline 11.0: until then the worker may still start it
    t.session_gone(session(0), stopped=False, now=10.1, grace_s=0.2)
    t.session_gone(session(1), stopped=False, now=10.1, grace_s=0.2)
    assert t.expire(10.9) == []
    assert [o.settle for o in t.expire(11.0)] == [True]
    assert t.get(job.job_id) is None


def test_a_reconnect_inherits_the_jobs_of_its_process() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    assert t.rebind(session(1), 555) == [(job, 1)]
    with pytest.raises(KvdError):
        t.ack(job.job_id, session(1), 1, True, 0, 0.0)  # the old session no longer answers
    t.ack(job.job_id, session(0), 0, True, 0, 0.0)
    o = t.ack(job.job_id, 555, 1, True, 0, 0.0)
    assert o is not None and o.settle and o.job.ok


def test_a_reset_fails_jobs_but_settles_them_only_when_their_ranks_are_done() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    (o,) = t.fail_pool("p", "reset")
    assert o.report and not o.settle and t.num_unsettled("p") == 1
    assert t.fail_pool("other", "reset") == []
    t.ack(job.job_id, session(0), 0, True, 0, 0.0)
    o = t.ack(job.job_id, session(1), 1, True, 0, 0.0)
    assert o is not None and o.settle and not o.job.ok and t.num_unsettled("p") == 0
