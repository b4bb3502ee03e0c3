"""Runs in the daemon: the disk tier's fault seam, for what no device here can do (SPEC 16).

`KVD_DISK_FAULTS`, read when a slab is opened, makes its row I/O fail: a
comma list of `read_eio`, `write_eio`, `read_short` (each applying to every
call), `read_slow_ms=N` and `write_slow_ms=N` (every read or write waits
that long first: a stalled disk). Unset in
production: every field false, nothing changes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("kvd.io.disk_faults")


@dataclass(frozen=True)
class Faults:
    """The fault seam (`KVD_DISK_FAULTS`): what every row read or write does instead."""

    read_eio: bool = False
    write_eio: bool = False
    read_short: bool = False
    read_slow_s: float = 0.0
    write_slow_s: float = 0.0

    @classmethod
    def from_env(cls) -> Faults:
        spec = os.environ.get("KVD_DISK_FAULTS", "")
        if not spec:
            return cls()
        names = {p.strip().partition("=")[0]: p.strip().partition("=")[2] for p in spec.split(",")}
        slow = names.pop("read_slow_ms", "")
        slow_writes = names.pop("write_slow_ms", "")
        unknown = set(names) - {"read_eio", "write_eio", "read_short", ""}
        if unknown:
            raise ValueError(f"KVD_DISK_FAULTS: unknown {sorted(unknown)}")
        log.warning("event=disk_faults_injected faults=%s", spec)
        return cls("read_eio" in names, "write_eio" in names, "read_short" in names,
                   int(slow) / 1000 if slow else 0.0,
                   int(slow_writes) / 1000 if slow_writes else 0.0)  # fmt: skip
