"""Runs in the daemon (pure core): the index's big arrays, made a piece at a time.

A new pool's index is built on a thread while the event loop serves
(`kvd.control.pool_builds`). One C call that fills 32 MiB (an `array` made
from `bytes(8 * n)`, a list of 4M `None`) holds the GIL for tens of
milliseconds, which the loop would wait; made `PIECE_BYTES` at a time, each
call holds it a millisecond or so, and the loop takes its turn in between.
The total cost is the same.
"""

from __future__ import annotations

from array import array
from typing import Any

PIECE_BYTES = 1 << 20


def filled(typecode: str, n: int, value: int = 0) -> array[int]:
    """`array(typecode, [value]) * n`, made a piece at a time."""
    out = array(typecode)
    per = max(1, PIECE_BYTES // out.itemsize)
    piece = array(typecode, [value]) * min(n, per)
    for _ in range(n // per):
        out.extend(piece)
    out.extend(piece[: n % per])
    return out


def nones(n: int) -> list[Any]:
    """`[None] * n`, made a piece at a time (typed for any list of optionals)."""
    per = PIECE_BYTES // 8
    piece: list[Any] = [None] * min(n, per)
    out: list[Any] = []
    for _ in range(n // per):
        out.extend(piece)
    out.extend(piece[: n % per])
    return out
