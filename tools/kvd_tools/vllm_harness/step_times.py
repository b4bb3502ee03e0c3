"""Runs in vLLM's processes, for the benches only: where a step's time goes, in any engine.

`kvd bench peers --step-times DIR` starts its decode engines (kvd's,
LMCache's, no connector's) with `KVD_STEP_TIMES=DIR`, `KVD_STEP_TIMES_TAG`
= the system and `SITE_DIR` first on `PYTHONPATH`, whose `sitecustomize`
calls `install` in every Python process of the engine: the engine core
(vLLM's scheduler), its workers, and the harness's driver. `install` wraps,
as each module is imported, the step's parts that every system has (the
engine core's `step`, the scheduler's `schedule` and `update_from_output`,
the model runner's `execute_model`, `_model_forward` and `sample_tokens`)
and each connector's per-step hooks (kvd's, vLLM's offloading connector
kvd's derives from, LMCache's), and records each call's microseconds; each
process writes `<DIR>/steps-<pid>.json` every `DUMP_EVERY_S` (10 s; vLLM's
processes end on a SIGTERM, which skips `atexit`).

`report` reads them back: per system, the median call of each part (the
median over the system's processes of each process's median), so a part
the connector adds or lengthens shows against the no-connector engine's.
kvd's own `hook_times` times kvd's hooks only, in kvd's engines; this times
the same step in every system's. A wrapper costs about a microsecond a call,
in every system alike.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.abc
import importlib.machinery
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "KVD_STEP_TIMES"  # the directory the processes write to
TAG_ENV = "KVD_STEP_TIMES_TAG"  # the system whose engine this is
SITE_DIR = Path(__file__).with_name("step_site")  # its sitecustomize calls `install`
EVERY_ENV = "KVD_STEP_TIMES_EVERY_S"  # seconds between dumps, DUMP_EVERY_S by default
# vLLM's processes end on the harness's SIGTERM without running `atexit`: the
# calls after the last dump are not written (a dump holds the GIL for a few ms,
# so not often: it would land inside the steps it times).
DUMP_EVERY_S = 10.0
MAX_CALLS = 200_000  # kept a part and process; later calls are not recorded
_CONNECTOR_HOOKS = (
    "build_connector_meta", "update_connector_output", "get_kv_connector_stats",
    "start_load_kv", "wait_for_save", "get_finished", "get_transfer_results",
    "build_connector_worker_meta", "get_block_ids_with_load_errors",
)  # fmt: skip
# module -> (class, the methods timed, defined on that class); a subclass's
# override and the base's method it calls are timed apart.
TIMED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "vllm.v1.engine.core": (("EngineCore", ("step", "step_with_batch_queue")),),
    "vllm.v1.core.sched.scheduler": (("Scheduler", ("schedule", "update_from_output")),),
    "vllm.v1.worker.gpu_model_runner": (
        ("GPUModelRunner", ("execute_model", "_model_forward", "sample_tokens")),
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector": (
        ("OffloadingConnector", _CONNECTOR_HOOKS),
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector": (
        ("LMCacheMPConnector", _CONNECTOR_HOOKS),
    ),
    "kvd_client.vllm.connector": (("KvdOffloadingConnector", _CONNECTOR_HOOKS),),
}
# The rows of `report`, in this order: the step, then what it is made of.
PARTS = (
    ("EngineCore.step", "engine core: one step"),
    ("EngineCore.step_with_batch_queue", "engine core: one step (batch queue)"),
    ("Scheduler.schedule", "scheduler: schedule"),
    ("Scheduler.update_from_output", "scheduler: update_from_output"),
    ("GPUModelRunner.execute_model", "worker: execute_model"),
    ("GPUModelRunner._model_forward", "worker: forward pass"),
    ("GPUModelRunner.sample_tokens", "worker: sample_tokens"),
)
_calls: dict[str, list[float]] = {}  # "Class.method" -> microseconds of each call
_lock = [threading.Lock()]  # one dump at a time (the thread's, atexit's)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            took = (time.perf_counter_ns() - t0) / 1e3
            calls = _calls.setdefault(name, [])
            if len(calls) < MAX_CALLS:
                calls.append(took)

    timed.__kvd_step_timed__ = True  # type: ignore[attr-defined]
    return timed


def patch(module: ModuleType) -> None:
    """Wraps the methods `TIMED` names in `module` (once)."""
    for cls_name, methods in TIMED.get(module.__name__, ()):
        cls = getattr(module, cls_name, None)
        for method in methods:
            fn = cls.__dict__.get(method) if cls is not None else None
            if callable(fn) and not getattr(fn, "__kvd_step_timed__", False):
                setattr(cls, method, _timed(f"{cls_name}.{method}", fn))


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a `TIMED` module right after it is executed."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in TIMED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                patch(module)
            except Exception as exc:  # untimed, never an import error in vLLM
                note_error(f"cannot time {module.__name__}: {type(exc).__name__}: {exc}")

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def note_error(line: str) -> None:
    """Says why this process is not (wholly) timed, in `<KVD_STEP_TIMES>/steps-<pid>.error`,
    which `report` prints (an engine's own log goes when the bench stops it)."""
    where = os.environ.get(ENV)
    print(f"kvd step times: {line}", file=sys.stderr)
    if where:
        with contextlib.suppress(OSError), Path(where, f"steps-{os.getpid()}.error").open("a") as f:
            f.write(f"{os.environ.get(TAG_ENV, '?')}: {line}\n")


def dump() -> None:
    """Writes this process's calls to `<KVD_STEP_TIMES>/steps-<pid>.json` (whole, by rename)."""
    where = os.environ.get(ENV)
    if not where or not _calls:
        return
    with _lock[0]:
        title = (
            Path("/proc/self/comm").read_text().strip() if Path("/proc/self/comm").exists() else ""
        )
        # Copied before reading: a first call of a part may add a key meanwhile.
        calls = {name: list(times) for name, times in list(_calls.items())}
        record = {"tag": os.environ.get(TAG_ENV, ""), "process": title, "calls": calls}
        path = Path(where, f"steps-{os.getpid()}.json")
        part = path.with_suffix(".part")
        part.write_text(json.dumps(record))
        part.replace(path)


def _dump_now_and_then() -> None:
    try:
        every = float(os.environ.get(EVERY_ENV) or DUMP_EVERY_S)
    except ValueError:
        note_error(
            f"{EVERY_ENV}={os.environ.get(EVERY_ENV)!r} is not seconds: every {DUMP_EVERY_S}"
        )
        every = DUMP_EVERY_S
    while True:
        time.sleep(every)
        try:
            dump()
        except Exception as exc:  # say so once, stop: the calls so far were written
            note_error(f"cannot write: {type(exc).__name__}: {exc}")
            return


def _start_dumping() -> None:
    threading.Thread(target=_dump_now_and_then, name="kvd-step-times", daemon=True).start()


def install() -> None:
    """Times the `TIMED` methods in this process (and in processes it forks)."""
    if not os.environ.get(ENV):
        return
    sys.meta_path.insert(0, _Finder())
    for name in TIMED:
        if name in sys.modules:
            patch(sys.modules[name])
    atexit.register(dump)
    _start_dumping()
    # A forked child has no threads but this one and the parent's calls: its own.
    os.register_at_fork(after_in_child=_after_fork)


def _after_fork() -> None:
    _lock[0] = threading.Lock()  # the parent's dumping thread may have held it
    _calls.clear()
    _start_dumping()


def report(where: Path) -> list[str]:
    """Lines: per part of a step and per connector hook, each system's median call
    in microseconds (the median of its processes' medians), systems as columns;
    then why a process was not timed, and files that were not step times."""
    by_system: dict[str, dict[str, list[float]]] = {}
    skipped = []
    for path in sorted(where.glob("steps-*.json")):
        try:
            record = json.loads(path.read_text())
            tag, calls_by_part = record["tag"], record["calls"]
            medians = {name: statistics.median(calls)
                       for name, calls in calls_by_part.items() if calls}  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError, statistics.StatisticsError):
            skipped.append(path.name)
            continue
        parts = by_system.setdefault(tag or "?", {})
        for name, median in medians.items():
            parts.setdefault(name, []).append(median)
    errors = [line for path in sorted(where.glob("steps-*.error"))
              for line in path.read_text().splitlines()]  # fmt: skip
    lines = []
    if by_system:
        lines += _table(by_system)
    lines += [f"not timed: {line}" for line in errors]
    if skipped:
        lines.append(f"not step times, left out: {', '.join(skipped)}")
    return lines


def _table(by_system: dict[str, dict[str, list[float]]]) -> list[str]:
    systems = sorted(by_system)

    def median(system: str, name: str) -> float | None:
        values = by_system[system].get(name)
        return statistics.median(values) if values else None

    names = [name for name, _ in PARTS]
    hooks = sorted({n for parts in by_system.values() for n in parts if n not in names})
    label = dict(PARTS)
    less = "engine core: one step less the forward pass"
    width = max(len(label.get(n, n)) for n in [*names, *hooks, less])
    lines = [f"{'us, median call':{width}s} " + " ".join(f"{s:>10s}" for s in systems)]

    def row(title: str, cells: list[float | None]) -> str:
        shown = [f"{c:10.1f}" if c is not None else f"{'-':>10s}" for c in cells]
        return f"{title:{width}s} " + " ".join(shown)

    for name in names:
        if any(name in by_system[s] for s in systems):
            lines.append(row(label[name], [median(s, name) for s in systems]))
    # Everything a step spends outside vLLM's model, messages between the engine
    # core and its workers included: what a connector adds, all told.
    outside = []
    for s in systems:
        step = median(s, "EngineCore.step") or median(s, "EngineCore.step_with_batch_queue")
        forward = median(s, "GPUModelRunner._model_forward")
        outside.append(step - forward if step is not None and forward is not None else None)
    if any(c is not None for c in outside):
        lines.append(row(less, outside))
    for name in hooks:
        lines.append(row(name, [median(s, name) for s in systems]))
    if hooks:
        lines.append("(a connector's hook includes the base class's it calls: "
                     "KvdOffloadingConnector's holds OffloadingConnector's)")  # fmt: skip
    return lines
