"""Runs in the test process: the transfer-job state machine, no sockets."""

from __future__ import annotations

import pytest

from kvd.core.jobs import Job, JobTable
from kvd.errors import KvdError


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
        ranks=frozenset(range(ranks)),
        writers=frozenset({0}),
        now=now,
    )


def test_reported_and_settled_only_when_every_rank_acked() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    o = t.ack(job.job_id, 0, True, 100, 0.1)
    assert o is not None and not o.report and not o.settle
    o = t.ack(job.job_id, 1, True, 0, 0.2)
    assert o is not None and o.report and o.settle and o.job.ok
    assert o.job.nbytes == 100 and o.job.seconds == 0.2
    assert len(t) == 0


def test_failed_rank_reports_at_once_but_settles_after_the_others() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t, ranks=3)
    o = t.ack(job.job_id, 1, False, 0, 0.0, "boom")
    assert o is not None and o.report and not o.settle and not o.job.ok
    assert "rank 1 failed: boom" in o.job.failure
    o = t.ack(job.job_id, 0, True, 10, 0.0)
    assert o is not None and not o.report and not o.settle
    (o,) = t.rank_gone("e", 2)
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
    assert t.ack(job.job_id, 0, True, 0, 0.0) is None  # late ack of a forgotten job


def test_ack_misuse_raises() -> None:
    t = JobTable(timeout_s=1.0)
    job = make(t)
    with pytest.raises(KvdError):
        t.ack(job.job_id, 5, True, 0, 0.0)
    t.ack(job.job_id, 0, True, 0, 0.0)
    with pytest.raises(KvdError):
        t.ack(job.job_id, 0, True, 0, 0.0)


def test_fail_all_by_pool() -> None:
    t = JobTable(timeout_s=1.0)
    a = make(t)
    outcomes = t.fail_all("drop", pool="other")
    assert outcomes == []
    (o,) = t.fail_all("drop", pool="p")
    assert o.job is a and o.report and o.settle and o.job.failure == "drop"
    assert len(t) == 0
