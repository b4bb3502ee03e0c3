"""Runs in vLLM's processes, for the benches only: kvd's connector with its per-step hooks timed.

Where a step's time goes with kvd (issue 25): an engine whose
`kv_connector_module_path` names this module (`hook_times` in the harness
engine's config, a directory) gets kvd's connector and spec unchanged,
except that every hook vLLM calls on the connector in its scheduler process
and in its workers, and the worker's copies (`submit_store`,
`submit_load`, which run on the step's thread), add their calls and
seconds to a table that each process writes to `<dir>/<pid>.json` after
`DUMP_EVERY` calls, between hooks. `report` reads them back: microseconds a step, per
hook, for the scheduler side (a step = one `build_connector_meta`) and the
workers (a step = one `start_load_kv`). Importing it patches the classes in
the importing process, as `corrupt_loads` does; nothing outside the harness
and `kvd bench peers --hook-times` imports it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd_client.vllm import KvdOffloadingConnector, KvdOffloadingSpec
from kvd_client.vllm.worker import KvdOffloadingWorker

__all__ = ["KvdOffloadingConnector", "KvdOffloadingSpec", "report"]
ENV = "KVD_HOOK_TIMES"  # the directory, set by the harness engine for its children
DUMP_EVERY = 200
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "take_events", "get_kv_connector_stats",
)  # fmt: skip
WORKER_HOOKS = (
    "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
    "wait_for_save", "get_finished", "build_connector_worker_meta",
    "get_block_ids_with_load_errors", "bind_connector_metadata", "clear_connector_metadata",
)  # fmt: skip
COPIES = ("submit_store", "submit_load")
_table: dict[str, list[float]] = {}  # name -> [calls, seconds, the longest call's seconds]
_calls = [0]
_depth = [0]  # hooks running now: the copies run inside one


def _dump() -> None:
    where = os.environ.get(ENV)
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        Path(where, f"{os.getpid()}.json").write_text(json.dumps(_table))


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        _depth[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            took = time.perf_counter() - t0
            entry = _table.setdefault(name, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += took
            entry[2] = max(entry[2], took)
            _calls[0] += 1
            # Written only between hooks: a dump inside a copy would count in the
            # time of the hook that runs it (`start_load_kv`, `handle_preemptions`).
            if _calls[0] >= DUMP_EVERY and _depth[0] == 0:
                _calls[0] = 0
                _dump()

    timed.__kvd_timed__ = True  # type: ignore[attr-defined]
    return timed


def _patch(cls: type, names: tuple[str, ...]) -> None:
    for name in names:
        fn = getattr(cls, name, None)
        if fn is not None and not getattr(fn, "__kvd_timed__", False):
            setattr(cls, name, _timed(name, fn))


_patch(KvdOffloadingConnector, SCHEDULER_HOOKS + WORKER_HOOKS)
_patch(KvdOffloadingWorker, COPIES)


def report(where: Path) -> list[str]:
    """Lines: per process side, microseconds a step each hook took (the busiest first)."""
    lines = []
    for path in sorted(where.glob("*.json")):
        table = json.loads(path.read_text())
        side, step = (
            ("scheduler", "build_connector_meta")
            if "build_connector_meta" in table
            else ("worker", "start_load_kv")
        )
        steps = table.get(step, [0, 0.0])[0]
        if not steps:
            continue
        # The copies run inside a hook: listed, not added again.
        total = sum(entry[1] for name, entry in table.items() if name not in COPIES) / steps * 1e6
        parts = sorted(table.items(), key=lambda kv: -kv[1][1])
        detail = ", ".join(f"{name} {entry[1] / steps * 1e6:.1f}" for name, entry in parts)
        # The longest single calls: a hook that stalls one step hides in a mean.
        longest = sorted(
            ((entry[2], name) for name, entry in parts if len(entry) > 2), reverse=True
        )
        worst = ", ".join(f"{name} {sec * 1e3:.2f}" for sec, name in longest[:3])
        lines.append(
            f"{side} (pid {path.stem}, {steps} steps): {total:.0f} us a step: {detail}"
            + (f"; longest calls (ms): {worst}" if worst else "")
        )
    return lines
