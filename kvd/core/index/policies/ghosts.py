"""Runs in the daemon (pure core): ARC's ghost lists, as fingerprints in flat arrays.

A ghost remembers that a key was evicted recently; ARC only ever asks "was
this key a ghost, and on which list", so a ghost keeps a 64-bit fingerprint
of the key (`hash(key)`), never the key object. Each ghost is a node:

    fps:    [ fp0 ][ fp1 ] ... [ fpG-1 ]     array('q'), the fingerprint of node g
    order:  SlotLists(G, num_lists)          each list oldest first, through the nodes
    free:   fresh node ids G' = next_fresh.., then freed ones (a LIFO stack)
    table:  [ g | -1 ][ g | -1 ] ...         array('i'), 2**k >= 2G cells,
                                             open addressing on fp, linear probing

A lookup probes the table from cell `fp & mask` until it finds a node with that
fingerprint or an empty cell; a removal closes the gap by shifting the rest of
the probe run back (no tombstones, so the table never needs a rebuild). With at
most G ghosts in at least 2G cells, the load stays at or below one half, so a
probe run is short on average and every operation is O(1) expected.

A fingerprint stands for its key: two keys with equal 64-bit hashes share a
ghost. That false positive (odds about n / 2**64 per lookup) only makes ARC
adapt its target once for a key it never saw; no block is lost or mistaken.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvd.core.index.policies.arrays import filled
from kvd.core.index.policies.slot_lists import SlotLists

_EMPTY = -1


class GhostLists:
    """`num_lists` FIFO lists of fingerprints, at most `max_ghosts` in all, with membership.

    Memory is fixed at construction: 17 bytes per possible ghost for the nodes
    (fingerprint, links, tag) plus 8 to 16 for the table. `sizes[lst]` is the
    length of each list, for callers to read, never to write.
    """

    def __init__(self, max_ghosts: int, num_lists: int) -> None:
        self.max_ghosts = max_ghosts
        self._fps = filled("q", max_ghosts)
        self._order = SlotLists(max_ghosts, num_lists)
        self.sizes = self._order.sizes
        self._next_fresh = 0
        self._free = array("i")
        size = 1
        while size < 2 * max_ghosts:
            size *= 2
        self._mask = size - 1
        self._table = filled("i", size, _EMPTY)

    # -- queries --------------------------------------------------------------

    def __len__(self) -> int:
        return sum(self.sizes)

    def find(self, fp: int) -> int:
        """The list holding fingerprint `fp`, or -1 when it is no ghost."""
        # `_cell_of`, spelled out: ARC asks this for every block it stores.
        table, fps, mask = self._table, self._fps, self._mask
        cell = fp & mask
        while (node := table[cell]) != _EMPTY:
            if fps[node] == fp:
                return self._order.list_of(node)
            cell = (cell + 1) & mask
        return -1

    def fingerprints(self, lst: int) -> list[int]:
        """The fingerprints of `lst`, oldest first."""
        return [self._fps[node] for node in self._order.walk(lst)]

    # -- changes ----------------------------------------------------------------

    def add(self, lst: int, fps: Iterable[int]) -> None:
        """Appends each of `fps` as the newest ghost of `lst`, in order; there must be room."""
        nodes: list[int] = []
        table, mask, fp_of, free = self._table, self._mask, self._fps, self._free
        for fp in fps:
            if self._next_fresh < self.max_ghosts:
                node = self._next_fresh
                self._next_fresh += 1
            else:
                node = free.pop()  # IndexError: more than max_ghosts, a caller bug
            fp_of[node] = fp
            cell = fp & mask
            while table[cell] != _EMPTY:
                cell = (cell + 1) & mask
            table[cell] = node
            nodes.append(node)
        self._order.append(lst, nodes)

    def take(self, fp: int) -> int:
        """Removes fingerprint `fp` and returns the list it was on, or -1 when absent."""
        cell = self._cell_of(fp)
        if cell < 0:
            return -1
        node = self._table[cell]
        lst = self._order.list_of(node)
        self._order.unlink((node,))
        self._unindex((node,))
        return lst

    def drop_oldest(self, lst: int, count: int) -> None:
        """Forgets the `count` oldest ghosts of `lst` (at most its size)."""
        if count > 0:
            self._unindex(self._order.pop_oldest(lst, count))

    def clear(self) -> None:
        self._order.clear()
        self._next_fresh = 0
        self._free = array("i")
        self._table = array("i", [_EMPTY]) * len(self._table)

    # -- the table ----------------------------------------------------------------

    def _cell_of(self, fp: int) -> int:
        table, fps, mask = self._table, self._fps, self._mask
        cell = fp & mask
        while (node := table[cell]) != _EMPTY:
            if fps[node] == fp:
                return cell
            cell = (cell + 1) & mask
        return -1

    def _unindex(self, nodes: Iterable[int]) -> None:
        """Frees `nodes` (already off their lists): empties each one's table cell
        and closes the gap in its probe run."""
        table, fps, mask, free = self._table, self._fps, self._mask, self._free
        for node in nodes:
            free.append(node)
            # The node is known: compare node ids, not fingerprints, along the run.
            gap = fps[node] & mask
            while table[gap] != node:
                gap = (gap + 1) & mask
            cell = (gap + 1) & mask
            while (moved := table[cell]) != _EMPTY:
                # An entry may fill the gap unless its home cell lies after the
                # gap (cyclically, within gap+1..cell): its probe would skip it.
                home = fps[moved] & mask
                if (cell - home) & mask >= (cell - gap) & mask:
                    table[gap] = moved
                    gap = cell
                cell = (cell + 1) & mask
            table[gap] = _EMPTY

    # -- integrity ----------------------------------------------------------------

    def check(self) -> list[str]:
        """Where the ghosts are inconsistent (empty when they are not). O(table).

        The lists must be sound, every ghost node must sit in exactly one table
        cell reachable from its home cell, and free + linked nodes must add up.
        """
        problems = self._order.check()
        table, mask = self._table, self._mask
        cells = [node for node in table if node != _EMPTY]
        linked = [n for n in range(self._next_fresh) if self._order.list_of(n) >= 0]
        if sorted(cells) != linked:
            problems.append("the table's nodes are not exactly the linked ghost nodes")
        for node in linked:
            cell = self._fps[node] & mask
            while table[cell] not in (node, _EMPTY):
                cell = (cell + 1) & mask
            if table[cell] != node:
                problems.append(f"ghost node {node} cannot be reached from its home cell")
                break
        if len(set(self._free)) + len(linked) != self._next_fresh or any(
            self._order.list_of(n) >= 0 for n in self._free
        ):
            problems.append("free ghost nodes and linked ones do not add up")
        if len(cells) * 2 > mask + 1:
            problems.append(f"table load {len(cells)}/{mask + 1} is above one half")
        return problems
