"""Runs in the test process: `EngineProcess.pin` binds every thread of an engine's
process session (the harness and the processes it started) and nothing else, and
leaves a thread already bound within the CPUs (vLLM's OpenMP threads) as it is.

A real process tree stands in for vLLM's: a parent that starts a child, each
with a thread besides its main one, in its own session as `EngineProcess`
starts its harness. The child is in a process group of its own, as vLLM's
processes need not be in the harness's: the session is what counts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvd_tools.vllm_harness.driver import EngineProcess, stop_group

CHILD = (
    "import os, sys, threading, time; os.setpgrp(); "
    "bind = sys.argv[1]; bind and os.sched_setaffinity(0, {int(bind)}); "
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
    "print('up', os.getpid(), flush=True); time.sleep(60)"
)
TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
time.sleep(60)
"""


def _threads(session: int) -> dict[int, tuple[int, set[int]]]:
    """tid -> (pid, affinity), for every thread of every process in `session`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rfind(")") + 2 :].split()[3]) != session:
                continue
            for task in (entry / "task").iterdir():
                out[int(task.name)] = (int(entry.name), os.sched_getaffinity(int(task.name)))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _tree(bind: str) -> tuple[subprocess.Popen[str], EngineProcess, int]:
    proc = subprocess.Popen([sys.executable, "-c", TREE, CHILD, bind], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    word, child = proc.stdout.readline().split()
    assert word == "up"
    engine = EngineProcess.__new__(EngineProcess)  # its process only, no vLLM
    engine.proc = proc
    return proc, engine, int(child)


def _end(proc: subprocess.Popen[str]) -> None:
    stop_group(proc)
    for pid in {pid for pid, _ in _threads(proc.pid).values()}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the child, in a process group of its own
    if proc.stdout is not None:
        proc.stdout.close()


CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell a binding")
def test_pin_binds_the_session_and_only_it() -> None:
    mine = os.sched_getaffinity(0)
    proc, engine, child = _tree("")
    try:
        before = _threads(proc.pid)
        assert {pid for pid, _ in before.values()} == {proc.pid, child}
        assert len(before) >= 4 and all(cpus == mine for _, cpus in before.values())
        assert engine.pin({CPUS[0]}) == len(before)
        after = _threads(proc.pid)
        assert set(after) == set(before)
        assert all(cpus == {CPUS[0]} for _, cpus in after.values())
        assert os.sched_getaffinity(0) == mine, "the test's own process is not in the session"
    finally:
        _end(proc)


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell a binding")
def test_pin_leaves_threads_already_bound_within_the_cpus() -> None:
    # The child's threads on one CPU, as vLLM binds an OpenMP thread to one core:
    # pinned to two CPUs, they stay on their one, not widened to both.
    proc, engine, child = _tree(str(CPUS[0]))
    try:
        engine.pin({CPUS[0], CPUS[1]})
        after = _threads(proc.pid)
        child_cpus = [cpus for pid, cpus in after.values() if pid == child]
        assert len(child_cpus) >= 2 and all(cpus == {CPUS[0]} for cpus in child_cpus)
        assert all(cpus <= {CPUS[0], CPUS[1]} for _, cpus in after.values())
    finally:
        _end(proc)


def test_pin_refuses_a_session_with_no_threads() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    time.sleep(0.1)
    engine = EngineProcess.__new__(EngineProcess)
    engine.proc = proc
    with pytest.raises(RuntimeError, match="no thread of engine"):
        engine.pin({CPUS[0]})
