"""Runs in the operator's shell: `kvd bench lookup`, lookups from the ready table vs in process.

One private daemon, one pool with every key stored. For each batch size,
`Scheduler.lookup` of that many keys (all hits: the longest probe) is timed
from the pool's ready table (SPEC section 15), over the round trip
(`use_table=False`), and `BlockIndex.lookup` in this process on the same
keys, interleaved in one run. `ratio` is the table's p50 over the in-process
p50 (goal: at most 2x at 64 keys); `path` says which reader ran: the probe
loop in C (`kvd_client/_readytable.c`), or the Python one where it was not
built.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess

LAYOUT_ARGS = ("bench-lookup", "bfloat16", 16, 1, False, 4096)


def _time(fn: Callable[[list[bytes]], object], keys: list[bytes], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        a = time.perf_counter_ns()
        fn(keys)
        samples.append((time.perf_counter_ns() - a) / 1e3)
    return samples


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd.core.index import BlockIndex
    from kvd_client import Layout, Scheduler
    from kvd_tools.bench.suites import SuiteError

    sizes: list[int] = args.keys
    num_blocks = max(*sizes, args.blocks)
    keys = [bytes([i % 251]) * 28 + i.to_bytes(8, "big") for i in range(num_blocks)]  # 36 bytes
    index = BlockIndex(num_blocks)
    out = index.prepare_store(keys)
    assert out is not None
    index.complete_store(keys)
    rows = []
    layout = Layout(*LAYOUT_ARGS)
    capacity = num_blocks * layout.slot_bytes
    total = max_total_bytes([pool_footprint("bench-lookup", layout, capacity)])
    flags = {**PRIVATE_FLAGS, "max-total-bytes": total}
    with DaemonProcess(base=flags) as daemon:
        endpoint = daemon.endpoint
        with (
            Scheduler("bench-lookup", layout, engine_id="bench", endpoint=endpoint,
                      capacity_bytes=capacity) as table,
            Scheduler("bench-lookup", layout, engine_id="bench", endpoint=endpoint,
                      use_table=False) as rpc,
        ):  # fmt: skip
            if table.table is None:
                raise SuiteError("the daemon published no ready table (ready_tables = false?)")
            for start in range(0, num_blocks, 4096):
                batch = keys[start : start + 4096]
                table.prepare_store(batch)
                table.complete_store(batch)
            for n in sizes:
                probe = keys[:n]
                if table.lookup(probe) != n or rpc.lookup(probe) != n or index.lookup(probe) != n:
                    raise SuiteError(f"a lookup of {n} stored keys did not hit them all")
                samples: dict[str, list[float]] = {"table": [], "rpc": [], "inproc": []}
                calls = {
                    "table": (table.lookup, args.repeats),
                    "rpc": (rpc.lookup, args.repeats // 10 or 1),
                    "inproc": (index.lookup, args.repeats),
                }
                for _ in range(args.rounds):  # interleaved: the machine's noise hits all three
                    for name, (fn, repeats) in calls.items():
                        samples[name] += _time(fn, probe, repeats)
                p50 = {name: statistics.median(s) for name, s in samples.items()}
                rows.append({
                    "keys": n,
                    "p50_us": p50["table"],
                    "p99_us": _p(samples["table"], 0.99),
                    "inproc_p50_us": p50["inproc"],
                    "ratio": p50["table"] / p50["inproc"],
                    "rpc_p50_us": p50["rpc"],
                    "path": f"table ({table.table.path})",
                })  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    at64 = [r for r in rows if r["keys"] == 64]
    if not at64:
        return []
    r = at64[0]
    return [
        f"64 keys: {r['p50_us']:.1f} us from the table, {r['ratio']:.1f}x in process "
        f"(goal <= 2x), {r['rpc_p50_us'] / r['p50_us']:.1f}x faster than the round trip"
    ]
