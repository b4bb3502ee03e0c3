"""Runs in the operator's shell: replaying request traces through RAM above a
disk tier, as the daemon will drive the two (SPEC section 16, issue 27).

Two `BlockIndex` objects of one policy: RAM of `capacity` blocks and the disk
of `DISK_RATIO` x `capacity`. Per request:

    hits = ram.lookup(keys); ram.touch(keys[:hits])         RAM's leading hits
    run = disk.lookup(keys[hits:])                           the disk's leading run
    ram.prepare_store(keys[:hits + run]) + complete_store    read back into RAM
    ram.prepare_store(keys) + complete_store                 the misses stored
    disk.prepare_store(admitted) + complete_store            written behind

Blocks read from disk are present in RAM by the time the misses are stored,
so they are skipped there and never written to disk again. Of the blocks a
request stored into RAM, those the disk does not hold yet go to the
admission rule: `always` writes every one; `second` writes a block the second
time it is stored into RAM (Dynamo and Mooncake admit to SSD this way, to
spare its endurance), remembering at most `DISK_RATIO` x `capacity` blocks
seen once. Every store and write completes before the next request.

Hit rates are leading-prefix blocks over all block references: from RAM,
from disk, and the two together.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.core.index import BlockIndex
from kvd_tools.bench.suites import SuiteError

DISK_RATIO = 10  # the disk tier holds 10x the blocks of RAM (issue 27)
ADMISSIONS = ("always", "second")


@dataclass(frozen=True, slots=True)
class TierStats:
    """What one RAM + disk replay counted; hits are leading-prefix blocks."""

    num_ram_hits: int
    num_disk_hits: int
    num_refs: int
    num_disk_writes: int

    @property
    def ram_hit_rate(self) -> float:
        return self.num_ram_hits / self.num_refs if self.num_refs else 0.0

    @property
    def disk_hit_rate(self) -> float:
        return self.num_disk_hits / self.num_refs if self.num_refs else 0.0

    @property
    def hit_rate(self) -> float:
        return self.ram_hit_rate + self.disk_hit_rate


class Admission:
    """Which blocks stored into RAM are written to disk: `always` every one;
    `second` a block the second time it is stored, remembering at most
    `num_remembered` blocks stored once (the oldest forgotten first)."""

    def __init__(self, rule: str, num_remembered: int) -> None:
        if rule not in ADMISSIONS:
            raise SuiteError(f"disk admission {rule!r}: one of {', '.join(ADMISSIONS)}")
        self.rule = rule
        self.num_remembered = num_remembered
        self._seen_once: OrderedDict[bytes, None] = OrderedDict()

    def admit(self, keys: Sequence[bytes]) -> list[bytes]:
        if self.rule == "always":
            return list(keys)
        admitted: list[bytes] = []
        seen = self._seen_once
        for key in keys:
            if key in seen:
                del seen[key]  # admitted: on disk from now on, no longer "seen once"
                admitted.append(key)
                continue
            seen[key] = None
            if len(seen) > self.num_remembered:
                seen.popitem(last=False)
        return admitted


def replay_tiers(
    requests: Sequence[Sequence[int]], capacity: int, policy: str, admit: str
) -> TierStats:
    """Replays `requests` through RAM (`capacity` blocks) above a disk of
    `DISK_RATIO` x `capacity` blocks, as the module doc says."""
    ram = BlockIndex(capacity, policy)
    disk = BlockIndex(DISK_RATIO * capacity, policy)
    gate = Admission(admit, DISK_RATIO * capacity)
    num_ram = num_disk = num_refs = num_written = 0
    for ids in requests:
        keys = [i.to_bytes(8, "big") for i in ids]
        hits = ram.lookup(keys)
        assert hits is not None, "every store completes before the next request"
        ram.touch(keys[:hits])
        read = read_back(ram, disk, keys, hits)
        stored = store(ram, keys)
        num_written += write_behind(disk, gate.admit([k for k in stored if k not in disk]))
        ram.take_events()
        disk.take_events()
        num_ram += hits
        num_disk += read
        num_refs += len(keys)
    return TierStats(num_ram, num_disk, num_refs, num_written)


def read_back(ram: BlockIndex, disk: BlockIndex, keys: list[bytes], hits: int) -> int:
    """The disk's leading ready run after RAM's `hits`, read into RAM; its length.

    The RAM hits are in the `prepare_store` too, so that the read cannot evict
    them. Where RAM cannot hold the run the read is skipped: 0, all misses."""
    run = disk.lookup(keys[hits:])
    assert run is not None, "every disk write completes before the next request"
    if run == 0:
        return 0
    out = ram.prepare_store(keys[: hits + run])
    if out is None:
        return 0
    ram.complete_store(out.keys_to_store)
    disk.touch(keys[hits : hits + run])
    return run


def store(ram: BlockIndex, keys: list[bytes]) -> list[bytes]:
    """Stores the request's absent blocks into RAM (none if they do not fit); those keys."""
    out = ram.prepare_store(keys)
    if out is None:
        return []
    ram.complete_store(out.keys_to_store)
    return list(out.keys_to_store)


def write_behind(disk: BlockIndex, keys: list[bytes]) -> int:
    """Writes the admitted blocks to disk (none if they do not fit); how many."""
    if not keys:
        return 0
    out = disk.prepare_store(keys)
    if out is None:
        return 0
    disk.complete_store(out.keys_to_store)
    return len(out.keys_to_store)
