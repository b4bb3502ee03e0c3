"""Runs in the operator's shell: Belady's offline optimum (MIN) for a request trace,
with the same leading-prefix hit semantics as `kvd_tools.bench.replay`.

Per request: the hits are the leading blocks that are resident; every block of
the request not resident is then inserted, evicting the resident blocks whose
next use lies furthest in the future (never used again first), never a block
of the request itself. A request with more new blocks than the cache can make
room for is not stored, as `prepare_store` answers `None`.

When every request fits in the cache this bounds the hits of any policy
replayed by `kvd_tools.bench.replay` on a prefix trace (property-tested). Requests
larger than the cache skip their store, a bypass that greedy MIN does not
plan for, so there a policy can beat it by a little.

Cost O(R log R) for R block references: the next use of every reference is
precomputed in one backward pass, and a max-heap keyed on next use holds the
resident blocks, with lazy deletion (an entry is live only while it matches
the block's current next use; a block's next use only ever grows).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvd_tools.bench.replay import ReplayStats


def next_uses(requests: Sequence[Sequence[int]]) -> list[int]:
    """For each block reference, in trace order, the position of the next
    reference to the same block; the number of references R when there is none."""
    flat = [block for ids in requests for block in ids]
    never = len(flat)
    following: list[int] = [never] * never
    last_seen: dict[int, int] = {}
    for pos in range(never - 1, -1, -1):
        block = flat[pos]
        following[pos] = last_seen.get(block, never)
        last_seen[block] = pos
    return following


def belady(requests: Sequence[Sequence[int]], capacity: int) -> ReplayStats:
    """The leading-prefix hits of Belady's optimum with `capacity` blocks."""
    following = next_uses(requests)
    resident: dict[int, int] = {}  # block -> position of its next use
    heap: list[tuple[int, int]] = []  # (-next use, block): the furthest on top
    num_hits = num_skipped = 0
    start = 0
    for ids in requests:
        end = start + len(ids)
        hits = 0
        while hits < len(ids) and ids[hits] in resident:
            hits += 1
        num_hits += hits
        missing = list(dict.fromkeys(b for b in ids if b not in resident))
        num_present = len({b for b in ids if b in resident})
        store = len(missing) <= capacity - num_present
        if store:
            for _ in range(len(resident) + len(missing) - capacity):
                while True:
                    negated, block = heapq.heappop(heap)
                    if resident.get(block) == -negated:
                        break
                # Blocks of this request still hold a next use inside it, the
                # nearest of all, so they surface only if the request cannot fit.
                assert -negated >= end, "never evict a block of the current request"
                del resident[block]
        else:
            num_skipped += 1
        for pos, block in enumerate(ids, start):
            if store or block in resident:
                resident[block] = following[pos]
                heapq.heappush(heap, (-following[pos], block))
        start = end
    return ReplayStats(num_hits, start, num_skipped)
