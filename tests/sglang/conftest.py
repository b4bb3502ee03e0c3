"""Fixtures of the SGLang backend's tests: SGLang's own classes on CPU, a real daemon."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from kvd_tools.launcher import DaemonProcess
from kvd_tools.sglang_harness import missing

WHY = missing()
if WHY is not None:
    if importlib.util.find_spec("sglang") is not None:
        # Installed (make venv does) but its storage layer does not import: a
        # dependency `make` does not install. Skipping would hide it in CI.
        raise RuntimeError(f"sglang is installed but cannot be used: {WHY}")
    pytest.skip(WHY, allow_module_level=True)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess().start()
    try:
        yield d
    finally:
        d.stop()
