"""Runs in the daemon (pure core): doubly-linked lists of node ids in flat arrays.

The eviction policies order blocks by slot id, and the index already numbers
its slots 0..num_blocks-1, so a list needs no per-key dict and no node
objects: the links live in two `array('i')` indexed by node id. Each list is
circular through a sentinel node after the real ones, so linking and
unlinking never branch on "first" or "last".

    node:    0     1          N-1    N (sentinel of list 0)   N+1 (list 1) ...
    prev:  [ p0 ][ p1 ] ... [ pN-1 ][ tail of list 0 ]      [ tail of list 1 ]
    next:  [ n0 ][ n1 ] ... [ nN-1 ][ head of list 0 ]      [ head of list 1 ]
    tag:   [ t0 ][ t1 ] ... [ tN-1 ]    0 = on no list, l + 1 = on list l
    sizes: [ len(list 0), len(list 1), ... ]

    list 0:  N -> head (least recent) -> ... -> tail (most recent) -> N

A list of 1,000,000 nodes costs 9 bytes per node. Two arrays rather than one
interleaved one: in CPython the index arithmetic costs more than the second
cache line does. Every change takes a batch of nodes, so a policy pays one
Python call per batch, not per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice

from kvd.core.index.policies.arrays import filled


class SlotLists:
    """`num_lists` disjoint doubly-linked lists over node ids `0..num_nodes-1`.

    A node is on at most one list at a time. Each change is O(1) per node;
    `walk` is O(nodes walked), `clear` and `check` O(num_nodes). Misuse
    (appending a node that is already linked, unlinking one that is not) is a
    caller bug and corrupts the lists; `check` finds it. `sizes[lst]` is the
    length of each list, for callers to read, never to write (the same list
    object for the life of this one, so a caller may keep a reference).
    """

    def __init__(self, num_nodes: int, num_lists: int) -> None:
        self.num_nodes = num_nodes
        self.num_lists = num_lists
        self._prev = filled("i", num_nodes + num_lists)
        self._next = filled("i", num_nodes + num_lists)
        self._tag = bytearray(num_nodes)
        self.sizes = [0] * num_lists
        self._link_sentinels()

    def _link_sentinels(self) -> None:
        for sentinel in range(self.num_nodes, self.num_nodes + self.num_lists):
            self._prev[sentinel] = self._next[sentinel] = sentinel

    # -- queries --------------------------------------------------------------

    def list_of(self, node: int) -> int:
        """The list holding `node`, or -1 when it is on none."""
        return self._tag[node] - 1

    def __len__(self) -> int:
        return sum(self.sizes)

    def walk(self, lst: int) -> Iterator[int]:
        """The nodes of `lst`, least recent first. The list must not change meanwhile."""
        after = self._next
        sentinel = self.num_nodes + lst
        node = after[sentinel]
        while node != sentinel:
            yield node
            node = after[node]

    # -- changes ----------------------------------------------------------------

    def append(self, lst: int, nodes: Iterable[int]) -> None:
        """Links each of `nodes` (on no list) as the most recent node of `lst`, in order."""
        batch = nodes if isinstance(nodes, list) else list(nodes)
        if not batch:
            return
        prev, after, tag = self._prev, self._next, self._tag
        sentinel = self.num_nodes + lst
        tail = prev[sentinel]
        after[tail] = batch[0]
        prev[batch[0]] = tail
        for a, b in zip(batch, islice(batch, 1, None), strict=False):  # a chain, a -> b
            after[a] = b
            prev[b] = a
        after[batch[-1]] = sentinel
        prev[sentinel] = batch[-1]
        mark = lst + 1
        for node in batch:
            tag[node] = mark
        self.sizes[lst] += len(batch)

    def unlink(self, nodes: Iterable[int]) -> None:
        """Takes each of `nodes` off its list."""
        prev, after, tag, sizes = self._prev, self._next, self._tag, self.sizes
        for node in nodes:
            before, behind = prev[node], after[node]
            after[before] = behind
            prev[behind] = before
            sizes[tag[node] - 1] -= 1
            tag[node] = 0

    def move_to_end(self, lst: int, nodes: Iterable[int]) -> None:
        """Makes each of the linked `nodes` the most recent node of `lst`, in order
        (the last one ends most recent), from whichever list holds it."""
        prev, after, tag, sizes = self._prev, self._next, self._tag, self.sizes
        sentinel = self.num_nodes + lst
        for node in nodes:
            tail = prev[sentinel]
            if node == tail:
                continue  # already there; so below, unlinking never moves the tail
            before, behind = prev[node], after[node]
            after[before] = behind
            prev[behind] = before
            prev[node] = tail
            after[node] = sentinel
            after[tail] = node
            prev[sentinel] = node
            if tag[node] != lst + 1:  # a move between lists (ARC's promotion)
                sizes[tag[node] - 1] -= 1
                sizes[lst] += 1
                tag[node] = lst + 1

    def pop_oldest(self, lst: int, count: int) -> list[int]:
        """Unlinks the `count` least recent nodes of `lst` (at most its size); returns them."""
        prev, after, tag = self._prev, self._next, self._tag
        sentinel = self.num_nodes + lst
        nodes: list[int] = []
        node = after[sentinel]
        while len(nodes) < count and node != sentinel:
            nodes.append(node)
            tag[node] = 0
            node = after[node]
        after[sentinel] = node
        prev[node] = sentinel
        self.sizes[lst] -= len(nodes)
        return nodes

    def clear(self) -> None:
        """Empties every list."""
        self._tag = bytearray(self.num_nodes)
        self.sizes[:] = [0] * self.num_lists
        self._link_sentinels()

    # -- integrity ----------------------------------------------------------------

    def check(self) -> list[str]:
        """Where the lists are inconsistent (empty when they are not). O(num_nodes).

        Each list must be a closed ring through its sentinel whose links agree
        in both directions, hold exactly `sizes[lst]` nodes all tagged with it,
        and every tagged node must be on the list of its tag.
        """
        problems: list[str] = []
        prev, after, tag = self._prev, self._next, self._tag
        seen = 0
        for lst in range(self.num_lists):
            sentinel = self.num_nodes + lst
            before, node, count = sentinel, after[sentinel], 0
            while node != sentinel and count <= self.num_nodes:
                if not 0 <= node < self.num_nodes:
                    problems.append(f"list {lst} links to node {node}, out of range")
                    break
                if prev[node] != before:
                    problems.append(f"list {lst}: node {node}'s prev is not {before}")
                if tag[node] != lst + 1:
                    problems.append(f"list {lst} holds node {node} tagged {tag[node] - 1}")
                before, node, count = node, after[node], count + 1
            if node == sentinel and prev[sentinel] != before:
                problems.append(f"list {lst}: the sentinel's prev is not the tail {before}")
            if count != self.sizes[lst]:
                problems.append(f"list {lst} holds {count} nodes but counts {self.sizes[lst]}")
            seen += count
        tagged = sum(1 for t in tag if t)
        if tagged != seen:
            problems.append(f"{tagged} nodes are tagged but {seen} are linked")
        return problems
