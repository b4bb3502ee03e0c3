"""Runs in the test process: `EngineProcess.pin` binds every thread of an engine's
process session (the harness and the processes it started) and nothing else.

A real process tree stands in for vLLM's (a parent that starts a child, each
with a thread), in its own session as `EngineProcess` starts its harness.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvd_tools.vllm_harness.driver import EngineProcess, stop_group

TREE = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
child = subprocess.Popen([sys.executable, "-c",
    "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); "
    "print('up', flush=True); time.sleep(60)"], stdout=sys.stdout)
time.sleep(60)
"""


def _threads(session: int) -> dict[int, set[int]]:
    """tid -> affinity, for every thread of every process in `session`."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat[stat.rfind(")") + 2 :].split()[3]) != session:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                out[int(tid)] = os.sched_getaffinity(int(tid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell a binding")
def test_pin_binds_the_session_and_only_it() -> None:
    cpu = min(os.sched_getaffinity(0))
    mine = os.sched_getaffinity(0)
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        engine = EngineProcess.__new__(EngineProcess)  # its process only, no vLLM
        engine.proc = proc
        before = _threads(proc.pid)
        assert len(before) >= 4 and any(cpus != {cpu} for cpus in before.values())
        assert engine.pin({cpu}) == len(before)
        after = _threads(proc.pid)
        assert set(after) == set(before)
        assert all(cpus == {cpu} for cpus in after.values())
        assert os.sched_getaffinity(0) == mine, "the test's own process is not in the session"
    finally:
        stop_group(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def test_pin_refuses_a_session_with_no_threads() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    time.sleep(0.1)
    engine = EngineProcess.__new__(EngineProcess)
    engine.proc = proc
    with pytest.raises(RuntimeError, match="no thread of engine"):
        engine.pin({min(os.sched_getaffinity(0))})
