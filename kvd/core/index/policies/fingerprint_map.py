"""Runs in the daemon (pure core): a map from 32-bit fingerprints to node ids, in one flat table.

A miniature cache (`kvd.core.index.policies.miniature`) has no index to tell it
which node holds a key, so it keeps this map, without a dict entry or an
int object per key:

    fps:    [ fp of node 0 ][ fp of node 1 ] ...   array('I'), kept by the caller's cache
    table:  [ node | -1 ][ node | -1 ] ...         array('i'), 2**k >= 2 * num_nodes cells
    home cell of fp: (fp * 0x9E3779B1 mod 2**32) >> (32 - k), then linear probing

The table stores node ids only; a probe compares `fps[node]` with the
fingerprint sought. A removal closes the gap by shifting the rest of the
probe run back (no tombstones), as `GhostLists` does. With at most
`num_nodes` entries in at least twice as many cells, the load stays at or
below one half and every operation is O(1) expected: 8 bytes per node.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvd.core.index.policies.arrays import filled

_EMPTY = -1
_GOLDEN = 0x9E3779B1
_MASK32 = 0xFFFFFFFF


class FingerprintMap:
    """Fingerprint -> node id for up to `num_nodes` nodes, whose fingerprints live in `fps`."""

    def __init__(self, num_nodes: int, fps: array[int]) -> None:
        bits = 1
        while (1 << bits) < 2 * max(1, num_nodes):
            bits += 1
        self._shift = 32 - bits
        self._mask = (1 << bits) - 1
        self._table = filled("i", 1 << bits, _EMPTY)
        self._fps = fps
        self.num_entries = 0

    def get(self, fp: int) -> int:
        """The node holding `fp`, or -1."""
        table, fps, mask = self._table, self._fps, self._mask
        cell = ((fp * _GOLDEN) & _MASK32) >> self._shift
        while (node := table[cell]) != _EMPTY:
            if fps[node] == fp:
                return node
            cell = (cell + 1) & mask
        return _EMPTY

    def leading(self, fps: Sequence[int]) -> list[int]:
        """The nodes of the leading fingerprints of `fps` that are mapped, up to the first
        that is not (`get` for each, in one call: the miniatures' hit path)."""
        table, fp_of, mask, shift = self._table, self._fps, self._mask, self._shift
        nodes: list[int] = []
        for fp in fps:
            cell = ((fp * _GOLDEN) & _MASK32) >> shift
            while (node := table[cell]) != _EMPTY and fp_of[node] != fp:
                cell = (cell + 1) & mask
            if node == _EMPTY:
                break
            nodes.append(node)
        return nodes

    def put(self, node: int) -> None:
        """Maps `fps[node]` to `node`; the fingerprint must not be mapped already."""
        table, mask = self._table, self._mask
        cell = ((self._fps[node] * _GOLDEN) & _MASK32) >> self._shift
        while table[cell] != _EMPTY:
            cell = (cell + 1) & mask
        table[cell] = node
        self.num_entries += 1

    def remove(self, node: int) -> None:
        """Unmaps `node` (which must be mapped) and closes the gap in its probe run."""
        table, fps, mask, shift = self._table, self._fps, self._mask, self._shift
        gap = ((fps[node] * _GOLDEN) & _MASK32) >> shift
        while table[gap] != node:
            gap = (gap + 1) & mask
        cell = (gap + 1) & mask
        while (moved := table[cell]) != _EMPTY:
            # An entry may fill the gap unless its home cell lies after the gap
            # (cyclically, within gap+1..cell): its probe would not reach it.
            home = ((fps[moved] * _GOLDEN) & _MASK32) >> shift
            if (cell - home) & mask >= (cell - gap) & mask:
                table[gap] = moved
                gap = cell
            cell = (cell + 1) & mask
        table[gap] = _EMPTY
        self.num_entries -= 1

    def clear(self) -> None:
        self._table = array("i", [_EMPTY]) * len(self._table)
        self.num_entries = 0

    def nodes(self) -> list[int]:
        """Every mapped node, in table order."""
        return [node for node in self._table if node != _EMPTY]

    def check(self) -> list[str]:
        """Where the table is inconsistent (empty when it is not). O(table size)."""
        problems: list[str] = []
        nodes = self.nodes()
        if len(nodes) != self.num_entries or len(set(nodes)) != len(nodes):
            problems.append(f"the table holds {len(nodes)} nodes, counts {self.num_entries}")
        if len({self._fps[node] for node in nodes}) != len(nodes):
            problems.append("two nodes hold the same fingerprint")
        problems.extend(
            f"node {node} cannot be reached from its home cell"
            for node in nodes
            if self.get(self._fps[node]) != node
        )
        return problems[:5]
