"""Runs in the daemon (pure core): miniature caches that choose the adaptive policy's behaviour.

Miniature simulation (Waldspurger et al., "Cache Modeling and Optimization
using Miniature Simulations", USENIX ATC '17) on the spatial sampling of
SHARDS (Waldspurger et al., FAST '15): a key is sampled when its fingerprint
falls in a fixed share `rate` of the fingerprint space, so a sampled key is
sampled every time it comes back, and a cache of `rate * capacity` blocks
fed only the sampled keys behaves like the full cache, scaled down.

    lookup(keys) -> the sampled fingerprints, in prefix order
                 -> each miniature (one per behaviour of EXPERTS) replays the
                    request as the engine does: leading hits, touch them,
                    store the rest (evicting by its own rules)
                 -> sums[i] = decayed leading hits of miniature i
                    spread[i][j] = decayed (hits_i - hits_j)**2 per request
                 -> move from the current choice c to the best i only when
                    sums[i] - sums[c] > Z * sqrt(spread[i][c])

    miniature i:  ProbationCache(size, *EXPERTS[i])  over node ids 0..size-1
                  node_of: FingerprintMap {fingerprint -> node}, 8 bytes a node
                  free nodes: fresh ids ascending, then freed ones (a stack)

Hits count up to the first sampled key that misses, as prefix hits do: the
unsampled blocks in between are taken to be there, which the real cache's
tail-first order makes likely. At rate 1 a miniature counts exactly the
real cache's hits (tested). All miniatures see the same sample, so their
scores differ by their behaviour, not by the luck of the draw, and the
paired test above keeps noise from flipping the choice back and forth.

Bounds: `size = max(min(capacity, SAMPLE_BLOCKS), capacity / SAMPLE_SHARE)`,
so all miniatures together hold 5/16 of the capacity in blocks once the
capacity passes 4096 (about 19 bytes per slot of the real cache, with
their maps and doorkeepers), and 5 * 256 blocks below that. Per key of a
lookup they cost O(len(EXPERTS)) per sampled key, and the sample rate is
between 1/16 and 1.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Sequence

from kvd.core.index.policies.fingerprint_map import FingerprintMap
from kvd.core.index.policies.probation import LONG, SHORT, ProbationCache, always

# The behaviours to choose from, as (alpha, memory) of `ProbationCache`: the
# admission filter with a short and a long memory, two milder filters, LRU.
EXPERTS = ((0.0, SHORT), (0.0, LONG), (0.15, LONG), (0.6, LONG), (1.0, LONG))
START = 3  # before any evidence: a mild filter, close to LRU on every trace we know
SAMPLE_BLOCKS = 256  # blocks per miniature at least (or the capacity, if smaller) ...
SAMPLE_SHARE = 16  # ... and at least 1 / SAMPLE_SHARE of the capacity
DECAY_TURNOVERS = 64  # the scores' half-life, in sampled keys per miniature block
Z = 1.0  # how many standard deviations of evidence it takes to change behaviour
_BUCKETS = 65521  # a prime: `crc32 % prime` does not inherit crc32's linearity


class Miniature:
    """One shadow cache of `size` blocks with a fixed (alpha, memory), fed sampled fingerprints."""

    def __init__(self, size: int, alpha: float, memory: int) -> None:
        self.size = size
        self.cache = ProbationCache(size, always, always, alpha, memory, (memory,))
        self.node_of = FingerprintMap(size, self.cache.fingerprints)
        self._free: list[int] = []
        self._next_fresh = 0

    def request(self, fps: Sequence[int]) -> int:
        """Replays one request as the engine does; returns its leading hits."""
        get, cache = self.node_of.get, self.cache
        nodes = self.node_of.leading(fps)
        hits = len(nodes)
        if hits:
            nodes.reverse()
            cache.touch_ready(nodes)
            if hits == len(fps):
                return hits
        new = [fp for fp in dict.fromkeys(fps[hits:]) if get(fp) < 0]
        if not new or len(new) > self.size:
            return hits
        need = len(new) - (self.size - self.node_of.num_entries)
        if need > 0:
            protected: Collection[int] = (
                {node for fp in fps if (node := get(fp)) >= 0} if len(new) < len(fps) else ()
            )
            victims = cache.evict(need, protected)
            if victims is None:
                return hits
            for node in victims:
                self.node_of.remove(node)
            self._free.extend(victims)
        slots: list[int] = []
        for _ in new:
            if self._next_fresh < self.size:
                slots.append(self._next_fresh)
                self._next_fresh += 1
            else:
                slots.append(self._free.pop())
        cache.insert_fingerprints(slots, new)  # writes the fingerprints the map reads
        for node in slots:
            self.node_of.put(node)
        return hits

    def clear(self) -> None:
        self.cache.clear()
        self.node_of.clear()
        self._free.clear()
        self._next_fresh = 0

    def check(self) -> list[str]:
        label = f"miniature alpha={self.cache.alpha} memory={self.cache.memory}"
        problems = self.cache.check_invariants() + self.node_of.check()
        if sorted(self.cache.slots()) != sorted(self.node_of.nodes()):
            problems.append(f"{label}: nodes and map disagree")
        if self.node_of.num_entries + len(self._free) != self._next_fresh:
            problems.append(f"{label}: free and used nodes do not add up")
        return problems


class Miniatures:
    """One `Miniature` per behaviour of `EXPERTS`, over one sample of a cache of
    `capacity` blocks; `choice` is the index in `EXPERTS` of the best one lately."""

    def __init__(self, capacity: int) -> None:
        size = max(1, min(capacity, SAMPLE_BLOCKS), -(-capacity // SAMPLE_SHARE))
        self._threshold = max(1, round(_BUCKETS * size / capacity))
        self.rate = self._threshold / _BUCKETS
        self.minis = [Miniature(size, alpha, memory) for alpha, memory in EXPERTS]
        self._decay = 0.5 ** (1.0 / (DECAY_TURNOVERS * size))
        self.clear_scores()

    def clear_scores(self) -> None:
        k = len(self.minis)
        # Decayed sums, stored divided by `_weight` (the decay so far), so that
        # decaying them all is one multiplication: a true value is stored * weight.
        # _sums[i]: the hits of miniature i; _spread[i][j]: the squared per-request
        # differences in hits of i and j, the variance of _sums[i] - _sums[j].
        self._weight = 1.0
        self._sums = [0.0] * k
        self._spread = [[0.0] * k for _ in range(k)]
        self.choice = START

    def sample(self, keys: Sequence[bytes]) -> list[int]:
        """The fingerprints of the sampled keys of one lookup, in order."""
        threshold, crc32 = self._threshold, zlib.crc32
        return [fp for key in keys if (fp := crc32(key)) % _BUCKETS < threshold]

    def observe(self, keys: Sequence[bytes]) -> int:
        """Feeds the sampled keys of one lookup to every miniature; returns the choice."""
        fps = self.sample(keys)
        return self.observe_sample(fps) if fps else self.choice

    def observe_sample(self, fps: Sequence[int]) -> int:
        """`observe`, for a lookup already reduced to its (non-empty) `sample`."""
        self._weight *= self._decay ** len(fps)
        if self._weight < 1e-100:
            self._rescale()
        unit = 1.0 / self._weight
        hits = [mini.request(fps) for mini in self.minis]
        sums = self._sums
        first = hits[0]
        if hits.count(first) == len(hits):
            # No miniature gained on another: no difference and no decision changes.
            if first:
                for i in range(len(sums)):
                    sums[i] += first * unit
            return self.choice
        squared_unit = unit * unit
        spread = self._spread
        for i, h in enumerate(hits):
            sums[i] += h * unit
            row = spread[i]
            for j in range(i):
                if h != hits[j]:
                    row[j] = spread[j][i] = row[j] + (h - hits[j]) ** 2 * squared_unit
        # Move only on evidence: to the best score among the miniatures ahead of
        # the current one by more than Z standard deviations of their difference
        # (both sides in stored units: the weight cancels).
        current = self.choice
        best = current
        for i, total in enumerate(sums):
            if total > sums[best] and total - sums[current] > Z * spread[i][current] ** 0.5:
                best = i
        self.choice = best
        return best

    def _rescale(self) -> None:
        weight = self._weight
        self._sums = [total * weight for total in self._sums]
        self._spread = [[v * weight * weight for v in row] for row in self._spread]
        self._weight = 1.0

    @property
    def scores(self) -> list[float]:
        """Each miniature's decayed count of leading hits."""
        return [total * self._weight for total in self._sums]

    def clear(self) -> None:
        for mini in self.minis:
            mini.clear()
        self.clear_scores()

    def check(self) -> list[str]:
        problems = [p for mini in self.minis for p in mini.check()]
        if not 0 <= self.choice < len(self.minis):
            problems.append(f"choice {self.choice} is no miniature")
        return problems
