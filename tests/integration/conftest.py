"""Fixtures of the integration tests: a real daemon, real client processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvd_tools.launcher import DaemonProcess


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A daemon on the test flags; `indirect` parametrization passes more flags."""
    d = DaemonProcess(**getattr(request, "param", {})).start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[str]]]:
    """Collects child processes and kills whatever is left at the end of the test."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def python_child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
