"""Fixtures of the SGLang backend's tests: SGLang's own classes on CPU, a real daemon."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvd_tools.launcher import DaemonProcess
from kvd_tools.sglang_harness import missing

WHY = missing()
if WHY is not None:
    pytest.skip(WHY, allow_module_level=True)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        d.stop()
