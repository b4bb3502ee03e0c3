"""Runs in the daemon: a pool segment's slot table, mapped and written by the daemon (SPEC 13).

What each entry holds and in which order its bytes are written is pictured
in `kvd_client.segment`; `SlotTable` is the pool index's slot sink
(`kvd.core.index.types.SlotSink`), so every change of a slot's state reaches
the table as the index makes it, and a warm start reads it back
(`ready_map`, `in_use`).
"""

from __future__ import annotations

import importlib
import logging
import mmap
from collections.abc import Sequence
from typing import Any

from kvd_client.segment import (
    ENTRY,
    ENTRY_BYTES,
    FREE,
    PINNED_AT,
    READY,
    STORING,
    SegmentHeader,
    entry_crc,
)

log = logging.getLogger("kvd.io.slot_table")

_warmstart: Any
try:  # the slot-table scan in C, built with the package where a compiler was there
    _warmstart = importlib.import_module("kvd_client._warmstart")
except ImportError:  # pragma: no cover - depends on the install
    _warmstart = None


# A reset's states: READY -> FREE, the others as they are (`SlotTable.begin_reset`).
_READY_FREED = bytes(FREE if state == READY else state for state in range(256))


def _positions(raw: bytes, value: int) -> list[int]:
    """The offsets in `raw` of the bytes equal to `value`, in order (C-speed finds)."""
    found, at = [], raw.find(value)
    while at >= 0:
        found.append(at)
        at = raw.find(value, at + 1)
    return found


class SlotTable:
    """The segment's header and slot table, mapped by the daemon: the pool index's
    slot sink (`kvd.core.index.types.SlotSink`). Write order: `kvd_client.segment`."""

    def __init__(self, fd: int, header: SegmentHeader, *, fresh: bool) -> None:
        self.header = header
        self._base = header.table_offset
        self._mm = mmap.mmap(fd, header.data_offset)
        self.seq = 0  # the last store sequence number written
        self.resetting = False  # a Reset waits for copies: nothing is written READY
        if fresh:
            self._mm[: header.table_offset] = header.pack().ljust(header.table_offset, b"\0")

    def storing(self, slots: Sequence[int]) -> None:
        mm, base = self._mm, self._base
        for slot in slots:
            mm[base + slot * ENTRY_BYTES] = STORING

    def ready(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        if self.resetting:  # the pool's blocks are gone already: held, never served
            self.storing(slots)
            return
        mm, base, pack_into = self._mm, self._base, ENTRY.pack_into
        for slot, key in zip(slots, keys, strict=True):
            self.seq += 1
            at = base + slot * ENTRY_BYTES
            pack_into(mm, at, FREE, len(key), 0, entry_crc(key, self.seq), self.seq, key)
            mm[at] = READY  # last: the entry is whole before it says so

    def freed(self, slots: Sequence[int]) -> None:
        mm, base = self._mm, self._base
        for slot in slots:
            mm[base + slot * ENTRY_BYTES] = FREE

    def pinned(self, slots: Sequence[int]) -> None:
        mm, at = self._mm, self._base + PINNED_AT
        for slot in slots:
            mm[at + slot * ENTRY_BYTES] = 1

    def unpinned(self, slots: Sequence[int]) -> None:
        mm, at = self._mm, self._base + PINNED_AT
        for slot in slots:
            mm[at + slot * ENTRY_BYTES] = 0

    def reset(self) -> None:
        n, base = self.header.num_blocks, self._base
        self._mm[base : base + n * ENTRY_BYTES : ENTRY_BYTES] = bytes(n)
        self._mm[base + PINNED_AT : base + n * ENTRY_BYTES : ENTRY_BYTES] = bytes(n)
        self.resetting = False

    def begin_reset(self) -> None:
        """A Reset that waits for the pool's copies was acknowledged: from now on the
        table holds no READY entry, so a next daemon adopts none of the pool's
        blocks, and it still knows every slot a copy may touch. A READY entry that
        is pinned (a load may read it) becomes STORING first, which a warm start
        holds back like a store in flight; every other READY entry becomes FREE;
        STORING entries stay. Until `reset`, a block made ready is written STORING."""
        self.resetting = True
        n, base, mm = self.header.num_blocks, self._base, self._mm
        end = base + n * ENTRY_BYTES
        states = bytearray(mm[base:end:ENTRY_BYTES])
        for slot in _positions(mm[base + PINNED_AT : end : ENTRY_BYTES], 1):
            if states[slot] == READY:
                states[slot] = STORING
                mm[base + slot * ENTRY_BYTES] = STORING  # before any READY goes FREE
        mm[base:end:ENTRY_BYTES] = bytes(states).translate(_READY_FREED)

    def in_use(self) -> tuple[list[int], list[int]]:
        """What jobs of an earlier run may still touch (a warm start): the STORING
        slots, which a store job may still write, and the READY slots marked
        pinned, which a load job may still read; each in slot order."""
        base, n, mm = self._base, self.header.num_blocks, self._mm
        states = mm[base : base + n * ENTRY_BYTES : ENTRY_BYTES]
        pins = mm[base + PINNED_AT : base + n * ENTRY_BYTES : ENTRY_BYTES]
        storing = _positions(states, STORING)
        pinned = [slot for slot in _positions(pins, 1) if states[slot] == READY]
        return storing, pinned

    def ready_entries(self) -> tuple[list[int], list[bytes], int]:
        """The READY entries whose crc holds, oldest store first (by seq, then
        slot), a later duplicate of a key winning (on a tie, the lower slot):
        (slots, keys, entries refused). The refused are freed. In C where the
        package was built with it (`kvd_client._warmstart.scan`), the same answer."""
        slots, keys, refused, _ = self.ready_map()
        return slots, keys, refused

    def ready_map(self) -> tuple[list[int], list[bytes], int, dict[bytes, int] | None]:
        """`ready_entries`, and from C also {key: slot} of them, built with the
        keys (a warm start's index takes it as it is); None from Python."""
        base, n = self._base, self.header.num_blocks
        slot_of = None
        if _warmstart is not None:
            slots, keys, refused, self.seq, slot_of = _warmstart.scan(self._mm, base, n)
        else:
            slots, keys, refused, self.seq = self._scan(base, n)
        self.freed(refused)
        return slots, keys, len(refused), slot_of

    def _scan(self, base: int, n: int) -> tuple[list[int], list[bytes], list[int], int]:
        states = self._mm[base : base + n * ENTRY_BYTES : ENTRY_BYTES]
        found: dict[bytes, tuple[int, int]] = {}
        refused: list[int] = []
        unpack_from = ENTRY.unpack_from
        slot = states.find(READY)
        while slot >= 0:
            _, klen, _, crc, seq, raw = unpack_from(self._mm, base + slot * ENTRY_BYTES)
            key = raw[:klen]
            if not 1 <= klen <= 64 or entry_crc(key, seq) != crc:
                refused.append(slot)
            else:
                held = found.get(key)
                if held is None or held[0] < seq:  # scanned by slot: a tie keeps the lower
                    if held is not None:
                        refused.append(held[1])
                    found[key] = (seq, slot)
                else:
                    refused.append(slot)
            slot = states.find(READY, slot + 1)
        order = sorted(found.items(), key=lambda item: item[1])
        last = order[-1][1][0] if order else 0
        return [s for _, (_, s) in order], [k for k, _ in order], refused, last

    def flush(self) -> None:
        """The table's pages to their file (a disk slab's table, SPEC 16)."""
        self._mm.flush()

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            log.warning("event=slot_table_still_referenced; it is unmapped with its views")
