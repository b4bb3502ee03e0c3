"""The index's big arrays, made a piece at a time, equal what one call makes."""

from __future__ import annotations

from array import array

from kvd.core.index.policies.arrays import PIECE_BYTES, filled, nones


def test_pieces_make_the_same_arrays() -> None:
    for n in (0, 1, 7, PIECE_BYTES // 8, PIECE_BYTES // 4 + 3, 3 * PIECE_BYTES // 8 + 1):
        assert filled("q", n) == array("q", bytes(8 * n))
        assert filled("I", n) == array("I", bytes(4 * n))
        assert filled("i", n, -1) == array("i", [-1]) * n
        assert nones(n) == [None] * n
