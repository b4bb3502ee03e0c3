"""Runs in the test process: what the disk tier's restart and fault tests share (issue 27).

A host from `disk_hosts` (a daemon with a disk tier, two real worker
processes), an `Engine` on one of its pools, and the steps the tests take:
store a set of blocks and wait until the write-behind put them on disk,
push them out of RAM with other stores, read them back through the disk and
compare the bytes the workers load with the bytes they stored. Counters come
from an admin connection (`stats`), which makes no pool (the `counters`
helper of the remote tests attaches one, and with a disk tier that pool
would get a slab of its own). `disk_entries` reads a slab's entry table from
the test process, so a test knows which row of the .slab file holds a block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kvd_client import protocol as p
from kvd_client.connection import Connection
from kvd_client.segment import ENTRY, ENTRY_BYTES, HEADER, PAGE, READY, read_header
from kvd_tools.launcher import DaemonProcess
from tests.integration.disk_hosts import RAM_BLOCKS, ROW_BYTES
from tests.integration.remote_hosts import BLOCKS, TP, Engine, wait_for

SLAB_HEADER_BYTES = 4096  # rows start here (kvd.io.disk_slab.ALIGN)
DISK_ROW_BYTES = (ROW_BYTES + 4095) // 4096 * 4096


def stats(d: DaemonProcess) -> dict[str, int]:
    """The daemon's counters, through an admin connection (no pool is made)."""
    conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=5000)
    conn.connect()
    try:
        reply = conn.call(p.Stats)
        assert isinstance(reply, p.StatsResult)
        return dict(reply.counters)
    finally:
        conn.close()


def delta(after: dict[str, int], before: dict[str, int], name: str) -> int:
    """How much counter `name` moved between two `stats`."""
    return after.get(name, 0) - before.get(name, 0)


def pool_info(d: DaemonProcess, pool: str) -> p.PoolInfo | None:
    conn = Connection(d.endpoint, role="admin", keeper=False, timeout_ms=5000)
    conn.connect()
    try:
        reply = conn.call(p.Pools)
        assert isinstance(reply, p.PoolsResult)
        return next((i for i in reply.pools if i.name == pool), None)
    finally:
        conn.close()


def events(d: DaemonProcess, event: str) -> list[str]:
    """The daemon log's lines of `event=<event>` (every run in this runtime dir)."""
    try:
        text = d.log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if f"event={event} " in line + " "]


def pool_events(d: DaemonProcess, event: str, pool: str) -> list[str]:
    """`events` of one pool (`pool=<pool>` in the line)."""
    return [line for line in events(d, event) if f" pool={pool} " in line]


def keys_of(name: str, n: int = BLOCKS) -> list[bytes]:
    return [f"{name}/{i}".encode() for i in range(n)]


def written(d: DaemonProcess) -> int:
    return stats(d).get("disk.blocks_written", 0)


def store_on_disk(e: Engine, keys: list[bytes], seed: int) -> list[list[str]]:
    """Stores `keys` through the workers and waits until they are written to
    disk; the digests each rank stored."""
    d = e.host.daemon
    before = written(d)
    digests = e.store(keys, seed=seed)
    wait_for("the write-behind", lambda: written(d) >= before + len(keys))
    return digests


def push_out_of_ram(e: Engine, name: str) -> list[list[str]]:
    """Stores RAM_BLOCKS other blocks (each written to disk before the next
    store, so no write pins a row the next store must evict): every block
    stored before them leaves RAM. The digests of the last store's blocks
    (`fillers_in_ram`), which RAM keeps."""
    digests: list[list[str]] = []
    for round_ in range(RAM_BLOCKS // BLOCKS):
        digests = store_on_disk(e, keys_of(f"{name}-filler-{round_}"), seed=100 + round_)
    return digests


def fillers_in_ram(name: str) -> list[bytes]:
    """The last filler store's keys: still in RAM after `push_out_of_ram`."""
    return keys_of(f"{name}-filler-{RAM_BLOCKS // BLOCKS - 1}")


def lookups_until_settled(e: Engine, keys: list[bytes], timeout: float = 15.0) -> list[int | None]:
    """Lookups until one answers a number; every answer seen on the way, in order."""
    seen: list[int | None] = []

    def look() -> bool:
        hits = e.scheduler.lookup(keys)
        if not seen or seen[-1] != hits:
            seen.append(hits)
        return hits is not None

    wait_for("a lookup to settle", look, timeout)
    return seen


def read_back(e: Engine, keys: list[bytes], stored: list[list[str]]) -> list[int | None]:
    """Lookups until every key hits (through the disk), then a load whose bytes
    must be those stored, on every rank; the lookups' answers on the way."""
    seen: list[int | None] = []

    def look() -> bool:
        hits = e.scheduler.lookup(keys)
        if not seen or seen[-1] != hits:
            seen.append(hits)
        return hits == len(keys)

    wait_for(f"the {len(keys)} blocks to come back from disk", look)
    loaded = e.load(keys)
    for rank in range(TP):
        assert loaded[rank] == stored[rank], f"rank {rank}: the bytes loaded differ"
    return seen


def wait_clients_back(e: Engine, epoch: int, timeout: float = 30.0) -> None:
    """After a daemon restart: the scheduler reconnected (a new session epoch)
    and every worker re-attached to the pool (a load before that is refused)."""
    s = e.scheduler
    deadline = time.monotonic() + timeout
    while not (s.connected and s.epoch > epoch):
        assert time.monotonic() < deadline, "the scheduler did not come back"
        time.sleep(0.05)
    while (info := pool_info(e.host.daemon, s.pool)) is None or info.sessions < 1 + TP:
        assert time.monotonic() < deadline, f"the workers did not come back: {info}"
        time.sleep(0.05)


@dataclass(frozen=True)
class Entries:
    """A slab's entry table as its file holds it now: its id and READY keys -> rows."""

    slab_id: int
    rows: dict[bytes, int]


def disk_entries(disk_dir: Path, pool: str) -> Entries:
    """Reads `<pool>.entries` (a segment header and slot table, SPEC 16) without
    writing it: the READY entries' keys and their rows in the slab."""
    raw = (disk_dir / f"{pool}.entries").read_bytes()
    fields = HEADER.unpack_from(raw)
    num_blocks, row_bytes, data_offset = fields[4], fields[5], fields[11]
    header = read_header(raw[:PAGE], data_offset + num_blocks * row_bytes)
    rows = {}
    for slot in range(header.num_blocks):
        state, klen, _, _, _, key = ENTRY.unpack_from(raw, header.table_offset + slot * ENTRY_BYTES)
        if state == READY:
            rows[key[:klen]] = slot
    return Entries(header.generation, rows)


def row_offset(disk_slot: int) -> int:
    """Where row `disk_slot` starts in the .slab file."""
    return SLAB_HEADER_BYTES + disk_slot * DISK_ROW_BYTES
