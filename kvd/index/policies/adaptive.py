"""Runs in the daemon (pure core): the adaptive policy, admission that tunes itself.

Blocks stored once and never read again push out blocks that would be read;
an admission filter keeps them out, but only pays at small capacity: at
large capacity, where most blocks come back, admitting everything is right.
This policy is a `ProbationCache` (a probation segment for blocks seen once,
a main segment for proven ones, a doorkeeper of recent victims, prefix-aware
order; see `kvd.index.policies.probation`) whose behaviour, the pair (alpha,
memory), is chosen online by miniature simulations of the same rules
(`kvd.index.policies.miniature`):

    lookup(keys) --sampled keys--> Miniatures: one ProbationCache per
                                   behaviour of EXPERTS, at sample scale,
                                   scored by their recent prefix hits
                                       |  (alpha, memory) = EXPERTS[choice]
                                       v
    insert / touch / evict ------> ProbationCache(capacity): P and M
                                   segments, short and long doorkeepers

    EXPERTS:  (0, SHORT)  (0, LONG)  (0.15, LONG)  (0.6, LONG)  (1, LONG)
              admission filters ........ milder ........ START ..... LRU

Lookups drive the miniatures (SPEC section 4: `lookup` counts for
admission), so the choice follows the requests the engine makes, hits and
misses alike. Until the miniatures tell the behaviours apart, it is
EXPERTS[START]. Per key: O(1) for the real cache, plus O(len(EXPERTS)) per
sampled key for the miniatures; memory per slot at 1,000,000 slots: 67
bytes for the real cache, 19 for the miniatures (see their module docs).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.index.policies.base import Key, SlotPredicate
from kvd.index.policies.miniature import EXPERTS, START, Miniatures
from kvd.index.policies.probation import LONG, SHORT, ProbationCache


class AdaptivePolicy(ProbationCache):
    name = "adaptive"

    def __init__(self, capacity: int, is_ready: SlotPredicate, is_evictable: SlotPredicate) -> None:
        alpha, memory = EXPERTS[START]
        super().__init__(capacity, is_ready, is_evictable, alpha, memory, (SHORT, LONG))
        self.miniatures = Miniatures(capacity)

    def record_lookup(self, keys: Sequence[Key]) -> None:
        self.alpha, self.memory = EXPERTS[self.miniatures.observe(keys)]

    def clear(self) -> None:
        super().clear()
        self.miniatures.clear()
        self.alpha, self.memory = EXPERTS[START]

    def check_invariants(self) -> list[str]:
        problems = super().check_invariants() + self.miniatures.check()
        if (self.alpha, self.memory) != EXPERTS[self.miniatures.choice]:
            problems.append(f"alpha {self.alpha}, memory {self.memory}: not the choice")
        return problems
