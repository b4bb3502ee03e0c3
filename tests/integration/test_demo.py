"""Runs in the test process: `kvd demo --quick` end to end, real daemon and TP worker processes.

The demo runs as a child process in its own session (so a hung run is
killed with everything it started) and reports its rows as JSON. Every
process it starts inherits a marker in its environment, which is how the
test finds (and kills) any it left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvd_tools.launcher import DaemonProcess

TIMEOUT_S = 240  # ~15 s per variant on a quiet 2-core host; shared hosts are not quiet
MARK = "KVD_DEMO_TEST_MARK"


def _marked_pids(mark: str) -> list[int]:
    """Processes of ours whose environment carries `mark` (left behind by the demo)."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours
    return pids


def run_demo(args: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> Any:
    mark = uuid.uuid4().hex
    out = tmp_path / "rows.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd_tools.demo", "--quick", "--json", str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {}), MARK: mark},
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"kvd demo did not finish within {TIMEOUT_S} s:\n{output}")
    finally:
        leftovers = _marked_pids(mark)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
    print(output)
    assert proc.returncode == 0, output
    assert not leftovers, f"the demo left processes behind: {leftovers}"
    return output, json.loads(out.read_text())


def check_rows(rows: list[dict[str, Any]], variants: list[str]) -> None:
    assert sorted({r["variant"] for r in rows}) == variants
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        by_name = {r["request"]: r for r in mine}
        assert by_name["A1"]["cached_tokens"] == 0  # a cold pool
        assert by_name["B1"]["cached_tokens"] > 0  # the system prompt A1 stored
        for name in ("A2", "B2", "A3", "C2"):  # later turns reuse the earlier ones
            assert by_name[name]["cached_tokens"] > 0, name
            assert by_name[name]["loaded_bytes"] > 0, name
        first_after = next(r for r in mine if r["after_restart"])
        assert first_after["request"] == "A4"
        assert first_after["cached_tokens"] >= by_name["A3"]["prompt_tokens"] // 16 * 16
        for r in mine:
            assert r["max_abs_diff"] <= 1e-4, r
            assert r["tokens_match"], r


@pytest.fixture
def demo_daemon() -> Iterator[DaemonProcess]:
    # Leases long enough for a busy 2-core host; the test flags' 600 ms are not.
    d = DaemonProcess(lease_ms="10000", job_timeout_ms="30000").start()
    try:
        yield d
    finally:
        d.stop()


def test_demo_both_variants(demo_daemon: DaemonProcess, tmp_path: Path) -> None:
    output, rows = run_demo(["--endpoint", demo_daemon.endpoint], tmp_path)
    check_rows(rows, ["mha", "mla"])
    assert "ok: cached logits within" in output
    # A daemon the demo did not start keeps running (the demo drops only its pools).
    assert demo_daemon.proc is not None and demo_daemon.proc.poll() is None


def test_demo_starts_and_stops_its_own_daemon(tmp_path: Path) -> None:
    # No daemon answers at this endpoint: the demo starts its own.
    nowhere = f"ipc://{tmp_path / 'none.sock'}"
    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("kvd.kvd-demo-*")}
    output, rows = run_demo(["--variant", "mla"], tmp_path, env={"KVD_ENDPOINT": nowhere})
    check_rows(rows, ["mla"])
    started = [line for line in output.splitlines() if "started a daemon at ipc://" in line]
    assert started, output
    runtime_dir = Path(started[0].split("ipc://")[1].split()[0]).parent
    assert not runtime_dir.exists()
    assert {p.name for p in shm.glob("kvd.kvd-demo-*")} <= before  # its segments are gone
