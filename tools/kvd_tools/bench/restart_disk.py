"""Runs in the bench: `kvd bench restart`'s disk rows: a SIGKILL and a reboot (SPEC 16).

For each size (`--disk-sizes`, default 1,000,000 blocks of `--disk-row-bytes`,
4 KiB: a slab of 4 GiB): one private daemon with a disk tier in a directory
of its own under `--dir`, and one pool whose RAM holds a tenth of the
blocks (RAM_SHARE) over a slab that holds them all. Every block is stored
(its bytes written into its slot through this process's mapping, then
`complete_store`), BATCH blocks at a time, each batch written behind to
disk before the one after the next is stored (none skipped); the later
batches push the earlier ones out of RAM. `blocks_ready_before`: the blocks
on disk (`disk.blocks`). Then two rows, `tier` "disk":

- `event` "sigkill": the daemon SIGKILLed and started again on the same
  runtime and disk dirs: the pool's segment is adopted (the last blocks in
  RAM), and its slab.
- `event` "reboot": SIGKILLed again, the pool's segments unlinked first (a
  reboot wipes /dev/shm; the disk stays), started again: the pool is made
  empty at the first attach, and its slab adopted.

In each: `seconds_to_first_hit`, from the spawn to the first lookup that
hits the first block stored (on disk only: RAM holds the last ones), by a
scheduler that connects as soon as the new daemon listens;
`blocks_ready_after`, the blocks the slab's adoption took back (its log
line, with `adopt_seconds`, the adoption's own time); `blocks_verified`,
the blocks that lookups then find (the daemon reading from disk what RAM
has not got) holding the bytes stored for their key; `from_disk`, how many
of them the disk served (`disk.hits`).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import time
from typing import Any

from kvd_tools.bench.disk_setup import (
    RowBytes,
    counter,
    disk_bytes_for,
    disk_dir,
    disk_flags,
    wait_until,
)
from kvd_tools.bench.restarts import restart
from kvd_tools.bench.sizing import max_total_bytes, pool_footprint
from kvd_tools.launcher import DaemonProcess

POOL = "bench-restart-disk"
RAM_SHARE = 10  # RAM holds 1 / RAM_SHARE of the blocks
MIN_RAM_BLOCKS = 1024
BATCH = 8192


def _key(i: int) -> bytes:
    """As vLLM's offload keys: a 32-byte block hash, then KV-cache group 0."""
    return hashlib.blake2b(b"disk/%d" % i, digest_size=32).digest() + bytes(4)


class Setup:
    """One size's pool, slab and daemon flags."""

    def __init__(self, num_blocks: int, row_bytes: int) -> None:
        from kvd_client import Layout

        self.num_blocks, self.row_bytes = num_blocks, row_bytes
        self.layout = Layout("bench-restart-disk", "int8", 16, 1, False, row_bytes)
        self.ram_blocks = min(num_blocks, max(MIN_RAM_BLOCKS, num_blocks // RAM_SHARE))
        self.capacity = self.ram_blocks * row_bytes
        self.max_total = int(max_total_bytes([pool_footprint(POOL, self.layout, self.capacity)]))
        slab_blocks = num_blocks + num_blocks // 16 + 64
        self.disk_bytes = disk_bytes_for(slab_blocks, row_bytes, self.capacity, self.max_total)
        self.batch = max(1, min(BATCH, self.ram_blocks // 4))  # two in flight: half the pin cap

    def scheduler(self, daemon: DaemonProcess, engine: str) -> Any:
        from kvd_client import Scheduler

        return Scheduler(POOL, self.layout, engine_id=engine, endpoint=daemon.endpoint,
                         capacity_bytes=self.capacity, timeout_ms=60_000)  # fmt: skip


def _wait_written(s: Any, at_least: int) -> None:
    wait_until("the write-behind", lambda: counter(s, "disk.blocks_written") >= at_least, 300,
               0.005)  # fmt: skip


def _store_all(st: Setup, s: Any, data: RowBytes, keys: list[bytes]) -> None:
    """Every key stored, each batch written to disk before the one after next goes."""
    from kvd_client.worker import Mapping
    from kvd_tools.bench.suites import SuiteError

    assert s.attached is not None
    mapping = Mapping(s.attached, replicated=False)
    skipped = counter(s, "disk.writes_skipped")
    try:
        for first in range(0, len(keys), st.batch):
            _wait_written(s, first - st.batch)
            batch = keys[first : first + st.batch]
            out = s.prepare_store(batch)
            if out is None or list(out.keys_to_store) != batch:
                raise SuiteError("the pool did not take every block")
            for k, slot in zip(batch, out.store_spec.slots, strict=True):
                data.fill(mapping.mm, slot * st.row_bytes, k)
            s.complete_store(batch)
        _wait_written(s, len(keys))
    finally:
        mapping.close()
    if counter(s, "disk.writes_skipped") != skipped:
        raise SuiteError("the write-behind skipped blocks (disk.writes_skipped)")


def _lookup_settled(s: Any, keys: list[bytes]) -> int:
    """Lookups of `keys` until one answers and the next adds nothing (the daemon
    reading what it can from disk meanwhile); the leading hits. While a fetch
    runs, only its last key is looked up: a lookup of thousands of keys every
    millisecond would cost the daemon more than the fetch."""
    best = -1
    while True:
        hits: int | None = s.lookup(keys)
        if hits == len(keys) or (hits is not None and hits <= best):
            return int(hits)
        if hits is not None:
            best = hits
        while s.lookup(keys[-1:]) is None:
            time.sleep(0.001)


def _verify(st: Setup, s: Any, data: RowBytes, keys: list[bytes]) -> int:
    """Blocks found and equal to what was stored, looked up `step` at a time."""
    from kvd_client.worker import Mapping

    assert s.attached is not None
    mapping = Mapping(s.attached, replicated=False)
    step = max(1, min(4096, st.ram_blocks // 4))  # a fetch takes at most a quarter of the pool
    verified = 0
    try:
        for first in range(0, len(keys), step):
            batch = keys[first : first + step]
            hits = _lookup_settled(s, batch)
            if not hits:
                continue
            slots = s.prepare_load(batch[:hits]).slots
            verified += sum(data.matches(mapping.mm, slot * st.row_bytes, k)
                            for k, slot in zip(batch[:hits], slots, strict=True))  # fmt: skip
            s.complete_load(batch[:hits])
    finally:
        mapping.close()
    return verified


def _adopted(daemon: DaemonProcess) -> tuple[int, float]:
    """(blocks, seconds) of the slab's last adoption, from the daemon's log."""
    text = daemon.log_path.read_text(errors="replace")
    found = re.findall(r"event=disk_slab_adopted .*? blocks=(\d+) .*? seconds=([0-9.]+)", text)
    if not found:
        return 0, float("nan")
    return int(found[-1][0]), float(found[-1][1])


def _after(st: Setup, daemon: DaemonProcess, event: str, data: RowBytes,
           keys: list[bytes], before: int) -> dict[str, Any]:  # fmt: skip
    from kvd_tools.bench.suites import SuiteError

    t0 = restart(daemon, reboot=event == "reboot")
    with st.scheduler(daemon, f"bench-{event}") as s:
        while (hit := s.lookup(keys[:1])) is None or (hit == 0 and not s.connected):
            if time.monotonic() - t0 > 120:
                raise SuiteError(f"no answer within 120 s of the {event}")
            time.sleep(0.001)
        first_hit = time.monotonic() - t0
        if hit != 1:
            raise SuiteError(f"the first block did not come back from the disk after the {event}")
        hits0 = counter(s, "disk.hits")
        t1 = time.monotonic()
        verified = _verify(st, s, data, keys)
        verify_s = time.monotonic() - t1
        from_disk = counter(s, "disk.hits") - hits0 + 1  # the first hit's block too
    adopted, adopt_s = _adopted(daemon)
    return {"tier": "disk", "event": event, "num_blocks": st.num_blocks,
            "row_bytes": st.row_bytes, "blocks_ready_before": before,
            "blocks_ready_after": adopted, "blocks_verified": verified, "from_disk": from_disk,
            "seconds_to_first_hit": round(first_hit, 3), "adopt_seconds": adopt_s,
            "verify_seconds": round(verify_s, 3)}  # fmt: skip


def _one_size(num_blocks: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    st = Setup(num_blocks, args.disk_row_bytes)
    data = RowBytes(st.row_bytes)
    keys = [_key(i) for i in range(num_blocks)]
    with disk_dir(args.dir) as where:
        flags = disk_flags(where, max_total=st.max_total, disk_bytes=st.disk_bytes,
                           log_level="info")  # fmt: skip
        daemon = DaemonProcess(base=flags)
        try:
            daemon.start()
            with st.scheduler(daemon, "bench") as s:
                _store_all(st, s, data, keys)
                wait_until("disk.blocks", lambda: counter(s, "disk.blocks") >= num_blocks,
                           30, 0.05)  # fmt: skip
                before = counter(s, "disk.blocks")
            return [_after(st, daemon, event, data, keys, before)
                    for event in ("sigkill", "reboot")]  # fmt: skip
        finally:
            daemon.stop()


def disk_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [row for n in args.disk_sizes for row in _one_size(n, args)]


def summarize(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        back = r["blocks_verified"] / max(1, r["blocks_ready_before"])
        out.append(
            f"disk, {r['num_blocks']} blocks of {r['row_bytes']} B, after a {r['event']}: "
            f"{back:.1%} of the blocks on disk back and verified (goal 100 %), "
            f"{r['from_disk']} of them read from disk; first hit "
            f"{r['seconds_to_first_hit']:.2f} s after the start (goal < 2 s at 1M), the "
            f"slab's adoption {r['adopt_seconds']:.2f} s"
        )
    return out
