"""Runs in the operator's shell: `kvd bench mla`, bytes per block, replicated vs sharded pools.

For each TP size it starts a daemon, one scheduler and N real `Worker`s (in
this process, CPU tensors), stores the same blocks through a replicated (MLA)
and a sharded pool, and reads back what was measured: the pool's row size
(host bytes per block) and the bytes the workers copied device-to-host.
Replicated rows hold one slot and only rank 0 copies, so both are 1/N.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess

SLOT_BYTES = 64 << 10
NUM_BLOCKS = 32


def _pool(world_size: int, replicated: bool) -> tuple[str, Any, int]:
    """The pool of one measurement: its name, layout and capacity in bytes."""
    from kvd_client import Layout

    name = f"mla-{world_size}-{'r' if replicated else 's'}"
    layout = Layout(name, "bfloat16", 16, world_size, replicated, SLOT_BYTES)
    return name, layout, 4 * NUM_BLOCKS * SLOT_BYTES * world_size


def _measure(endpoint: str, world_size: int, replicated: bool) -> dict[str, Any]:
    import torch

    from kvd_client import Scheduler, Worker

    name, layout, capacity = _pool(world_size, replicated)
    caches = [torch.ones(NUM_BLOCKS, SLOT_BYTES, dtype=torch.uint8) for _ in range(world_size)]
    with Scheduler(name, layout, engine_id=name, endpoint=endpoint, capacity_bytes=capacity) as s:
        workers = [
            Worker(
                r,
                world_size,
                caches[r],
                pool=name,
                layout=layout,
                engine_id=name,
                endpoint=endpoint,
            )
            for r in range(world_size)
        ]
        try:
            keys = [i.to_bytes(8, "big") for i in range(NUM_BLOCKS)]
            ticket = s.store(keys, list(range(NUM_BLOCKS)))
            if ticket is None or ticket.job_id is None:
                raise RuntimeError("the store did not start")
            for w in workers:
                if not all(w.wait([ticket.job_id]).values()):
                    raise RuntimeError(f"rank {w.rank} failed the store")
            copied = sum(w.bytes_copied for w in workers)
            attached = s.attached
            assert attached is not None
            return {
                "world_size": world_size,
                "layout": "replicated" if replicated else "sharded",
                "host_bytes_per_block": attached.row_bytes,
                "d2h_bytes_per_block": copied // NUM_BLOCKS,
            }
        finally:
            for w in workers:
                w.close()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    cases = [(ws, replicated) for ws in args.world_sizes for replicated in (True, False)]
    total = max_total_bytes(pool_footprint(*_pool(*case)) for case in cases)  # all held at once
    with DaemonProcess(base={**PRIVATE_FLAGS, "max-total-bytes": total}) as daemon:
        for world_size, replicated in cases:
            rows.append(_measure(daemon.endpoint, world_size, replicated))
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for ws in sorted({r["world_size"] for r in rows}):
        rep = next(r for r in rows if r["world_size"] == ws and r["layout"] == "replicated")
        sh = next(r for r in rows if r["world_size"] == ws and r["layout"] == "sharded")
        host = rep["host_bytes_per_block"] / sh["host_bytes_per_block"]
        d2h = rep["d2h_bytes_per_block"] / sh["d2h_bytes_per_block"]
        exact = host * ws == 1 and d2h * ws == 1
        lines.append(
            f"TP={ws}: replicated/sharded host bytes {host:.4f}, d2h bytes {d2h:.4f} "
            f"({'exactly' if exact else 'NOT'} 1/{ws})"
        )
    return lines
