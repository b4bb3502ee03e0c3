"""Runs in the operator's shell: a description of the machine a benchmark ran on.

Numbers from two machines are not comparable, so every JSON report carries
this. Cheap by design: torch's version comes from its installed metadata, so
describing the machine never pays for importing torch.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kvd.version import __version__
from kvd_tools.bench.report import Value


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first `model name` of /proc/cpuinfo, else what `platform` knows, else None."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("model name", "Processor", "cpu model"):
            return value.strip()
    return platform.processor() or None


def ram_bytes() -> int | None:
    """Total physical memory, or None where sysconf cannot tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def torch_version() -> str | None:
    """The installed torch's version (without importing it), or None."""
    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def describe_machine() -> dict[str, Value]:
    """The `machine` object of a JSON report."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "num_cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "ram_bytes": ram_bytes(),
        "torch": torch_version(),
        "kvd": __version__,
    }
