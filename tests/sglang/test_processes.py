"""Several SGLang engine processes on one kvd pool, an engine restart, and a daemon SIGKILLed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from kvd_tools import sglang_harness as h
from kvd_tools.launcher import DaemonProcess
from tests.sglang.engine_child import PAGE
from tests.sglang.test_backend import fill, read


@pytest.fixture
def engines() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def engine(procs: list[subprocess.Popen[str]], *args: object) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sglang.engine_child", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    procs.append(proc)
    return proc


def result(proc: subprocess.Popen[str]) -> dict[str, dict[str, object]]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_engines_share_one_pool_and_a_restart_is_served(
    daemon: DaemonProcess, engines: list[subprocess.Popen[str]]
) -> None:
    """Two engine processes store two prompts at once into one pool; a third,
    started after both exited (an engine restart), finds and loads both."""
    writers = [engine(engines, daemon.endpoint, "shared", "store", seed) for seed in (1, 2)]
    for w, seed in zip(writers, ("1", "2"), strict=True):
        assert result(w)[seed]["stored"] == [True] * 8
    got = result(engine(engines, daemon.endpoint, "shared", "load", "1,2,3"))
    for seed in ("1", "2"):
        assert got[seed] == {"exists": 8, "loaded": [True] * 8, "equal": [True] * 8}
    assert got["3"]["exists"] == 0 and got["3"]["loaded"] == [False] * 8


def test_daemon_sigkilled_then_restarted(daemon: DaemonProcess) -> None:
    """SGLang's cache controller on kvd while the daemon is SIGKILLed: its backup
    and prefetch threads get misses and skipped stores, no exception, and they
    serve again once the daemon is back (a warm restart keeps what was stored)."""
    device = h.device_pool(tokens=512, page_size=PAGE)
    host = h.host_pool(device, layout="page_first")
    ctl = h.controller(device, host, h.kvd_extra(daemon.endpoint, "killed", kvd_timeout_ms=300))
    backend = ctl.storage_backend
    try:
        tokens = list(range(4 * PAGE))
        keys = h.page_hashes(tokens, PAGE)
        src = host.alloc(len(tokens))
        want = fill(host, src, seed=5)
        ctl.write_storage(src, tokens, hash_value=keys)
        assert ctl.ack_backup_queue.get(timeout=20).completed_tokens == len(tokens)

        daemon.kill()
        start = time.monotonic()
        while backend.batch_exists(keys) != 0:  # the table of a dead daemon goes stale
            assert time.monotonic() - start < 5
            time.sleep(0.05)
        dst = host.alloc(len(tokens))
        assert backend.batch_get_v1(keys, dst) == [False] * 4
        more = list(range(500, 500 + 2 * PAGE))
        ctl.write_storage(host.alloc(len(more)), more, hash_value=h.page_hashes(more, PAGE))
        assert ctl.ack_backup_queue.get(timeout=20).completed_tokens == 0  # skipped
        op = ctl.prefetch("during", tokens)
        assert ctl.prefetch_hit_queue.get(timeout=20).storage_hit_count == 0
        ctl.terminate_prefetch(op)
        assert time.monotonic() - start < 10
        assert all(t.is_alive() for t in (ctl.backup_thread, ctl.prefetch_thread))

        daemon.start()
        deadline = time.monotonic() + 20
        while not backend.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.connected
        while backend.batch_exists(keys) != 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # the warm restart's blocks come back to the table
        assert backend.batch_get_v1(keys, dst) == [True] * 4
        assert all(torch.equal(a, b) for a, b in zip(read(host, dst), want, strict=True))
        ctl.write_storage(host.alloc(len(more)), more, hash_value=h.page_hashes(more, PAGE))
        assert ctl.ack_backup_queue.get(timeout=20).completed_tokens == len(more)
    finally:
        backend.close()
        ctl.storage_stop_event.set()
