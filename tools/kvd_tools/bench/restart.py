"""Runs in the operator's shell: `kvd bench restart`, the cache across a daemon SIGKILL (SPEC 13).

For each size: one private daemon, one pool of that many 256-byte blocks.
Every block is stored (`prepare_store`, its bytes written into its slot
through this process's own mapping of the rows, then `complete_store`), the
daemon is SIGKILLed and started again on the same runtime dir. Reported:
blocks ready before and after, blocks verified (ready after the restart,
found by a lookup, and holding the bytes written for their key), seconds
from the new daemon's start (its process spawned) to the first lookup hit
of a new scheduler, which connects as soon as the daemon's control socket is
there (as an engine's would: no other round trip first), and the adoption's
own seconds from the daemon's log, and seconds from the start to the first
store accepted (`seconds_to_first_store`, into the one slot the pool has
free; then failed at once, as a copy that did not happen). The keys are
shaped as vLLM's offload keys (a 32-byte hash, then KV-cache group 0).

The slot table's cost on the store path: `prepare_store` + `complete_store`
of batches of 64 new keys on a full `BlockIndex` (every batch evicts), with
and without the segment's slot table as its slot sink, in this process, in
microseconds per key (`store_us_per_key_without` / `_with`).

A checksum of each block's bytes in its slot-table entry (SPEC 13: "if you
can afford it"): `block_crc_gb_per_s` is zlib's crc32 over 64 MiB of rows in
this process, the rate at which the daemon would have to read every stored
block to checksum it. One H100's host-to-device copy engine moves about 25
GB/s; a checksum slower than that would make the daemon the limit.

Each row says its `tier`: "ram" for these; "disk" for the disk tier's rows
(`kvd_tools.bench.restart_disk`: blocks back from the disk after a SIGKILL
and after a simulated reboot, the first disk hit at `--disk-sizes` blocks),
with the same fields. `--tiers` picks them (default both).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import time
from typing import Any

from kvd_tools.bench.restart_disk import disk_rows
from kvd_tools.bench.restart_disk import summarize as summarize_disk
from kvd_tools.bench.restarts import wait_for_new_socket
from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.launcher import PRIVATE_FLAGS, DaemonProcess

SLOT_BYTES = 256
LAYOUT_ARGS = ("bench-restart", "int8", 16, 1, False, SLOT_BYTES)
BATCH = 4096


def _key(i: int) -> bytes:
    """36 bytes, as vLLM's offload keys: a 32-byte block hash, then the KV-cache
    group (0) in 4 bytes (so that the adoption's stored events name one group)."""
    return hashlib.blake2b(i.to_bytes(8, "big"), digest_size=32).digest() + bytes(4)


def _content(key: bytes) -> bytes:
    return (key * (SLOT_BYTES // len(key) + 1))[:SLOT_BYTES]


def _store_cost(num_blocks: int, with_table: bool) -> float:
    """Microseconds per key of prepare_store + complete_store on a full index."""
    from kvd.core.index import BlockIndex
    from kvd.io.region import SlotTable
    from kvd_client.segment import SegmentHeader

    index = BlockIndex(num_blocks, "lru")
    fd = -1
    if with_table:
        size = SLOT_BYTES
        h = SegmentHeader(1, num_blocks, size, size, 1, size, False, "b", b"", "lru")
        fd = os.memfd_create("kvd-bench-slots")
        os.ftruncate(fd, h.data_offset)
        index.slot_sink = SlotTable(fd, h, fresh=True)
    try:
        n = 0
        spent = 0.0
        steps = 0
        while n < 3 * num_blocks:
            keys = [_key(i) for i in range(n, n + 64)]
            n += 64
            t0 = time.perf_counter()
            out = index.prepare_store(keys)
            assert out is not None
            index.complete_store(out.keys_to_store)
            index.take_events()
            if n > num_blocks:  # full: every batch evicts
                spent += time.perf_counter() - t0
                steps += 1
        return spent * 1e6 / (steps * 64)
    finally:
        if fd >= 0:
            os.close(fd)


def _blocks_ready(endpoint: str) -> int:
    """The bench pool's ready blocks, as the daemon counts them (`Pools`)."""
    from kvd_client import protocol as p
    from kvd_client.connection import Connection

    conn = Connection(endpoint, role="admin", keeper=False, timeout_ms=60_000)
    conn.connect()
    try:
        reply = conn.call(p.Pools)
    finally:
        conn.close()
    assert isinstance(reply, p.PoolsResult)
    return reply.pools[0].blocks_ready


def _crc_rate() -> float:
    """GB/s of zlib.crc32 over 64 MiB, best of three."""
    import zlib

    buf = os.urandom(1 << 20) * 64
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        zlib.crc32(buf)
        best = min(best, time.perf_counter() - t0)
    return len(buf) / best / 1e9


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = _ram_rows(args) if "ram" in args.tiers else []
    return rows + (disk_rows(args) if "disk" in args.tiers else [])


def _ram_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvd_client import Layout, Scheduler
    from kvd_client.worker import Mapping
    from kvd_tools.bench.suites import SuiteError

    rows = []
    for num_blocks in args.sizes:
        layout = Layout(*LAYOUT_ARGS)
        capacity = (num_blocks + 1) * SLOT_BYTES  # one slot stays free, for the first store
        total = max_total_bytes([pool_footprint("bench-restart", layout, capacity)])
        flags = {**PRIVATE_FLAGS, "log-level": "info", "max-total-bytes": total}
        daemon = DaemonProcess(base=flags)
        daemon.start()
        try:
            keys = [_key(i) for i in range(num_blocks)]
            with Scheduler("bench-restart", layout, engine_id="bench", endpoint=daemon.endpoint,
                           capacity_bytes=capacity, timeout_ms=60_000) as s:  # fmt: skip
                assert s.attached is not None
                rows_map = Mapping(s.attached, replicated=False)
                mm, row = rows_map.mm, s.attached.row_bytes
                for first in range(0, num_blocks, BATCH):
                    batch = keys[first : first + BATCH]
                    out = s.prepare_store(batch)
                    if out is None or len(out.keys_to_store) != len(batch):
                        raise SuiteError("the pool did not take every block")
                    for k, slot in zip(out.keys_to_store, out.store_spec.slots, strict=True):
                        mm[slot * row : slot * row + SLOT_BYTES] = _content(k)
                    s.complete_store(batch)
            before = _blocks_ready(daemon.endpoint)
            daemon.kill(signal.SIGKILL)
            st = daemon.socket_path.stat()  # the dead daemon's socket file
            stale = (st.st_ino, st.st_ctime_ns)
            t0 = time.monotonic()
            daemon.start(wait=False)
            wait_for_new_socket(daemon, stale, t0)
            with Scheduler("bench-restart", layout, engine_id="bench2", endpoint=daemon.endpoint,
                           timeout_ms=60_000) as s:  # fmt: skip
                while s.lookup(keys[:1]) != 1:
                    if time.monotonic() - t0 > 120:
                        raise SuiteError("no hit within 120 s of the restart")
                    time.sleep(0.001)
                first_hit = time.monotonic() - t0
                # A store right after the start, into the pool's one free slot.
                fresh = _key(num_blocks)
                while (out := s.prepare_store([fresh])) is None:
                    if time.monotonic() - t0 > 300:
                        raise SuiteError("no store accepted within 300 s of the restart")
                    time.sleep(0.001)
                first_store = time.monotonic() - t0
                s.complete_store(out.keys_to_store, success=False)
                assert s.attached is not None and s.attached.shm_name == rows_map.attached.shm_name
                verified = 0
                for first in range(0, num_blocks, 256):
                    batch = keys[first : first + 256]
                    hits = s.lookup(batch) or 0
                    slots = s.prepare_load(batch[:hits]).slots if hits else []
                    for k, slot in zip(batch[:hits], slots, strict=True):
                        if mm[slot * row : slot * row + SLOT_BYTES] == _content(k):
                            verified += 1
                    if hits:
                        s.complete_load(batch[:hits])
                after = _blocks_ready(daemon.endpoint)
            rows_map.close()
            found = re.findall(r"event=pool_adopted .* seconds=([0-9.]+)", daemon.log())
            rows.append({
                "tier": "ram",
                "num_blocks": num_blocks,
                "blocks_ready_before": before,
                "blocks_ready_after": after,
                "blocks_verified": verified,
                "seconds_to_first_hit": first_hit,
                "seconds_to_first_store": first_store,
                "adopt_seconds": float(found[-1]) if found else float("nan"),
                "store_us_per_key_without": _store_cost(min(num_blocks, 100_000), False),
                "store_us_per_key_with": _store_cost(min(num_blocks, 100_000), True),
                "block_crc_gb_per_s": _crc_rate(),
            })  # fmt: skip
        finally:
            daemon.stop()
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["tier"] == "disk":
            out += summarize_disk([r])
            continue
        back = r["blocks_verified"] / max(1, r["blocks_ready_before"])
        out.append(
            f"{r['num_blocks']} blocks: {back:.1%} of the ready blocks back and verified "
            f"(goal 100 %), first hit {r['seconds_to_first_hit']:.2f} s after the start "
            f"(goal <= 2 s at 1M), first store accepted {r['seconds_to_first_store']:.2f} s "
            f"after the start; slot table on the store path "
            f"{r['store_us_per_key_with'] / r['store_us_per_key_without']:.2f}x; "
            f"a crc32 of every block's bytes would run at {r['block_crc_gb_per_s']:.1f} GB/s"
        )
    return out
