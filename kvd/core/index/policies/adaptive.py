"""Runs in the daemon (pure core): the adaptive policy, admission that tunes itself.

Blocks stored once and never read again push out blocks that would be read;
an admission filter keeps them out, but only pays at small capacity: at
large capacity, where most blocks come back, admitting everything is right.
This policy is a `ProbationCache` (a probation segment for blocks seen once,
a main segment for proven ones, a doorkeeper of recent victims, prefix-aware
order; see `kvd.core.index.policies.probation`) whose behaviour, the pair (alpha,
memory), is chosen online by miniature simulations of the same rules
(`kvd.core.index.policies.miniature`):

    lookup(keys) --its keys------> (waiting, up to MAX_PENDING_KEYS keys)
                 ----------------> Miniatures: one ProbationCache per
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
misses alike. A lookup only queues its keys (O(1) on the latency path);
the miniatures sample and replay the waiting lookups, in order, before the
next insert or eviction (the verbs the choice steers, so they decide exactly
as if replayed at once), one by one while the daemon is idle (`settle`,
after 1 ms without requests and until a request waits), or all at once
when more than MAX_PENDING_KEYS keys wait. A lookup of the same keys as the
previous one, with nothing inserted since, is not queued: it is a scheduler
asking again about a request that still waits, one request to the
miniatures. Until the miniatures tell the behaviours apart, the choice is
EXPERTS[START].

Per key: O(1) for the real cache, plus O(len(EXPERTS)) per sampled key for
the miniatures; memory per slot at 1,000,000 slots: 67 bytes for the real
cache, 19 for the miniatures (see their module docs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

from kvd.core.index.policies.base import Key, SlotPredicate
from kvd.core.index.policies.miniature import EXPERTS, START, Miniatures
from kvd.core.index.policies.probation import LONG, SHORT, ProbationCache

MAX_PENDING_KEYS = 1024  # keys of the lookups waiting for the miniatures, at most


class AdaptivePolicy(ProbationCache):
    name = "adaptive"

    def __init__(self, capacity: int, is_ready: SlotPredicate, is_evictable: SlotPredicate) -> None:
        alpha, memory = EXPERTS[START]
        super().__init__(capacity, is_ready, is_evictable, alpha, memory, (SHORT, LONG))
        self.miniatures = Miniatures(capacity)
        self._pending: deque[tuple[Key, ...]] = deque()
        self._pending_keys = 0
        self._last_lookup: tuple[Key, ...] = ()

    def record_lookup(self, keys: Sequence[Key]) -> None:
        # A lookup only queues its keys; the miniatures sample and replay them
        # before the next insert or eviction, the only verbs the choice steers,
        # so a lookup (the latency-critical verb) pays O(1) and decides the same.
        lookup = tuple(keys)
        if lookup == self._last_lookup:
            # The same keys again with nothing inserted since: an engine's
            # scheduler asking again about a request still waiting to run. It
            # is one request, so the miniatures see it once.
            return
        self._last_lookup = lookup
        self._pending.append(lookup)
        self._pending_keys += len(keys)
        if self._pending_keys > MAX_PENDING_KEYS:
            self._decide()

    def insert(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        if self._pending:
            self._decide()
        self._last_lookup = ()
        super().insert(slots, keys)

    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        if self._pending:
            self._decide()
        return super().evict(n, protected)

    def settle(self) -> bool:
        """Replays the oldest waiting lookup; True while more wait."""
        if self._pending:
            self._replay_oldest()
            self.alpha, self.memory = EXPERTS[self.miniatures.choice]
        return bool(self._pending)

    def has_idle_work(self) -> bool:
        return bool(self._pending)

    def _decide(self) -> None:
        while self._pending:
            self._replay_oldest()
        self.alpha, self.memory = EXPERTS[self.miniatures.choice]

    def _replay_oldest(self) -> None:
        keys = self._pending.popleft()
        self._pending_keys -= len(keys)
        sample = self.miniatures.sample(keys)
        if sample:
            self.miniatures.observe_sample(sample)

    def clear(self) -> None:
        super().clear()
        self.miniatures.clear()
        self._pending.clear()
        self._pending_keys = 0
        self._last_lookup = ()
        self.alpha, self.memory = EXPERTS[START]

    def check_invariants(self) -> list[str]:
        problems = super().check_invariants() + self.miniatures.check()
        if (self.alpha, self.memory) != EXPERTS[self.miniatures.choice]:
            problems.append(f"alpha {self.alpha}, memory {self.memory}: not the choice")
        waiting = sum(map(len, self._pending))
        if waiting != self._pending_keys or waiting > MAX_PENDING_KEYS:
            problems.append(f"{waiting} keys wait ({self._pending_keys} counted)")
        return problems
