"""Runs in the daemon (pure core): the doorkeeper, a bounded memory of keys seen recently.

The adaptive policy admits a block straight to its main segment when its key
was evicted not long ago: a second sighting (the "doorkeeper" of TinyLFU,
Einziger, Friedman & Manes, ACM ToS 2017; the ghost queue of S3-FIFO, Yang et
al., SOSP '23). It only ever asks "was this fingerprint added lately?", so the
doorkeeper is a set of 32-bit fingerprints in two generations of open
addressing, with no per-key objects, no links and no deletion:

    young: [ fp | 0 ][ fp | 0 ] ...   array('I'), 2**k >= 2 * half cells,
    old:   [ fp | 0 ][ fp | 0 ] ...   the same; 0 marks an empty cell
    a fingerprint lives in cell (fp * 0x9E3779B1 mod 2**32) >> (32 - k), or
    the next free one after it (linear probing)

`add` writes into `young`; when `young` holds `half` fingerprints, `old` is
dropped, `young` becomes `old` and a fresh table starts (the two-generation
aging of a TinyLFU doorkeeper reset, without losing everything at once). So
a fingerprint is remembered for between `half` and `2 * half` later additions,
and the load of each table stays at or below one half: probe runs are short,
every operation is O(1) expected, the rotation O(1) amortized.

Fingerprint 0 is stored as 1. Two keys with equal fingerprints share a
memory: at worst a key is admitted as seen when it was not (odds about
2 * half / 2**32 per key), which orders a block, never loses one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvd.core.index.policies.arrays import filled

_GOLDEN = 0x9E3779B1  # Fibonacci hashing: spreads structured fingerprints over the cells
_MASK32 = 0xFFFFFFFF


class Doorkeeper:
    """The fingerprints added within the last `half` to `2 * half` additions.

    Memory is fixed at construction: two tables of 4-byte cells, 2**k >= 2 *
    half each, so 16 to 32 bytes per fingerprint of `half`. A fingerprint
    already remembered by `young` is not added twice.
    """

    def __init__(self, half: int) -> None:
        self.half = max(1, half)
        bits = 1
        while (1 << bits) < 2 * self.half:
            bits += 1
        self._shift = 32 - bits
        self._size = 1 << bits
        self._young = filled("I", self._size)
        self._old = filled("I", self._size)
        self._num_young = 0
        self._num_old = 0

    def __len__(self) -> int:
        """How many fingerprints both generations hold (a fingerprint in both counts twice)."""
        return self._num_young + self._num_old

    def __contains__(self, fp: object) -> bool:
        return isinstance(fp, int) and self.knows(fp)

    def knows(self, fp: int) -> bool:
        """True when `fp` (cut to 32 bits) was added lately."""
        fp = (fp & _MASK32) or 1
        home = ((fp * _GOLDEN) & _MASK32) >> self._shift
        mask = self._size - 1
        for table in (self._young, self._old):
            cell = home
            while (held := table[cell]) != 0:
                if held == fp:
                    return True
                cell = (cell + 1) & mask
        return False

    def add(self, fps: Iterable[int]) -> None:
        """Remembers each of `fps` (32-bit values; larger ones are cut to their low 32 bits)."""
        shift, mask = self._shift, self._size - 1
        young = self._young
        for raw in fps:
            fp = (raw & _MASK32) or 1
            cell = ((fp * _GOLDEN) & _MASK32) >> shift
            while (held := young[cell]) != 0 and held != fp:
                cell = (cell + 1) & mask
            if held == fp:
                continue
            if self._num_young == self.half:
                # A new generation; `fp` goes first into the fresh table.
                self._old = young
                self._num_old = self._num_young
                young = self._young = array("I", bytes(4 * self._size))
                self._num_young = 0
                cell = ((fp * _GOLDEN) & _MASK32) >> shift
            young[cell] = fp
            self._num_young += 1

    def clear(self) -> None:
        self._young = array("I", bytes(4 * self._size))
        self._old = array("I", bytes(4 * self._size))
        self._num_young = self._num_old = 0

    def check(self) -> list[str]:
        """Where the tables are inconsistent (empty when they are not). O(table size).

        Each table must hold as many fingerprints as it counts, at most `half`,
        each once and each reachable from its home cell.
        """
        problems: list[str] = []
        mask = self._size - 1
        for label, table, count in (
            ("young", self._young, self._num_young),
            ("old", self._old, self._num_old),
        ):
            held = [fp for fp in table if fp != 0]
            if len(held) != count or count > self.half:
                problems.append(f"{label} holds {len(held)} fingerprints, counts {count}")
            if len(set(held)) != len(held):
                problems.append(f"{label} holds a fingerprint twice")
            for fp in held:
                cell = ((fp * _GOLDEN) & _MASK32) >> self._shift
                while table[cell] not in (fp, 0):
                    cell = (cell + 1) & mask
                if table[cell] != fp:
                    problems.append(f"{label}: fingerprint {fp} unreachable from its home cell")
                    break
        return problems
