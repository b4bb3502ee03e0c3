"""kvd_client: the library an inference engine links to use a kvd daemon.

Runs in engine processes. `Scheduler` (the engine's scheduler process) asks
the daemon where blocks are and starts transfer jobs; `Worker` (each TP
worker) maps the pool and copies blocks. Names are imported lazily so that
light modules (`kvd_client.errors`, `kvd_client.types`, `kvd_client.protocol`)
load without ZeroMQ or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvd_client.errors import ErrorCode, KvdError
    from kvd_client.protocol import JobResult, Layout
    from kvd_client.scheduler import Scheduler
    from kvd_client.types import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput, StoreTicket
    from kvd_client.worker import Worker

_LAZY = {
    "ErrorCode": "kvd_client.errors",
    "KvdError": "kvd_client.errors",
    "JobResult": "kvd_client.protocol",
    "Layout": "kvd_client.protocol",
    "Scheduler": "kvd_client.scheduler",
    "Worker": "kvd_client.worker",
    "LoadStoreSpec": "kvd_client.types",
    "OffloadingEvent": "kvd_client.types",
    "PrepareStoreOutput": "kvd_client.types",
    "StoreTicket": "kvd_client.types",
}

__all__ = [
    "ErrorCode",
    "JobResult",
    "KvdError",
    "Layout",
    "LoadStoreSpec",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "Scheduler",
    "StoreTicket",
    "Worker",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvd_client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
