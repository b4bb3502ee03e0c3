"""Runs in the soak harness: which failure paths the daemon's log says the faults reached.

The daemon logs one `event=` line per transition (level info), so its log
tells whether a fault reached the code it was meant for:

    jobs_rebound        a worker process reconnected and its new session took
                        over the jobs the old one owed (`Transfers.rebind`)
    worker_replaced     a new session registered for a rank that had one
    lease_expired       a session's lease lapsed (stalls, SIGKILLs)
    session_held        a lapsed session's slots held one more lease
    failed_not_started  a job a worker refused: past its deadline, never named
                        (the timed-out stores of the timeout scheduler)
    failed_went_away    a job failed because a rank's session ended
    failed_timed_out    a job failed at its deadline
    failed_other        any other reason (a rank's copy failed, a restart)
    adopted.<pool>      blocks the restarted daemon adopted warm in that pool
                        (`pool_adopted`, SPEC 13)

The `failed_*` counts are per pool (`failed_went_away.soak`), so one pool's
faults show apart from the other's.

`went_away_cause` answers why the daemon failed a job for a rank that "went
away": the event just before its `job_failed` line, in the same handler.
A worker's lease ran out (`lease_expired`: its process was starved, or
stopped) is a reason; anything else, for a job that every rank acked with no
stall near, is a violation.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

_EVENT = re.compile(r"\bevent=(\w+)")
_FIELD = re.compile(r"\b(\w+)=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\S*)")
COUNTED = ("jobs_rebound", "worker_replaced", "lease_expired", "session_held")


def _failure_kind(reason: str) -> str:
    if "not started" in reason:
        return "failed_not_started"
    if "went away" in reason:
        return "failed_went_away"
    if "timed out" in reason:
        return "failed_timed_out"
    return "failed_other"


def daemon_evidence(log: Path) -> dict[str, int]:
    """Counts of the events above in the daemon's log (every run of it appends there)."""
    counts: Counter[str] = Counter({name: 0 for name in COUNTED})
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return dict(counts)
    for line in text.splitlines():
        match = _EVENT.search(line)
        if match is None:
            continue
        event = match.group(1)
        if event in COUNTED:
            counts[event] += 1
        elif event == "pool_adopted":
            fields = dict(_FIELD.findall(line))
            counts[f"adopted.{fields.get('pool', '?')}"] += int(fields.get("blocks_ready", 0))
        elif event == "job_failed":
            fields = dict(_FIELD.findall(line))
            counts[f"{_failure_kind(fields.get('reason', ''))}.{fields.get('pool', '?')}"] += 1
    return dict(sorted(counts.items()))


# Lines a session's end logs between its cause and the failures of its jobs.
_BETWEEN = ("session_held", "session_rolled_back", "job_failed")


def went_away_cause(log: Path, job: int) -> tuple[str, list[str]]:
    """(the event that made the daemon fail `job`, the log lines before it)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "no daemon log", []
    mark = f"event=job_failed job={job} "
    at = next((i for i, line in enumerate(lines) if mark in line), None)
    if at is None:
        return "no job_failed line", []
    context = lines[max(0, at - 4) : at + 1]
    for line in reversed(lines[max(0, at - 20) : at]):
        match = _EVENT.search(line)
        if match is None or match.group(1) in _BETWEEN:
            continue
        event = match.group(1)
        if event == "lease_expired" and "role=worker" in line:
            return "lease_expired", context
        return event, context
    return "nothing before it", context
