"""Runs in the daemon (pure core): a policy that learns a warm restart's blocks a slice at a time.

At a million blocks `CachePolicy.adopt` takes about a second, as long as
the rest of a warm start together (SPEC 13: the first hit within 2 s). So the
daemon's `BlockIndex.adopt(..., policy_later=True)` answers lookups and
loads at once and puts this policy in front of the pool's own one, which
learns the adopted blocks `ADOPT_SLICE` at a time, oldest store first, at
each `settle` (the daemon's idle work):

    index.policy -> AdoptingPolicy -> the pool's policy (LRU, ARC, adaptive)
                    slots[:done] adopted, the rest to come;
                    the lookups and touches seen meanwhile, in order

The lookups and touches it is told meanwhile are kept, in order, and given
to the policy once it holds every block, so that the policy ends exactly as
if it had adopted them all first (each policy's `adopt` of consecutive
slices is its `adopt` of the whole: `CachePolicy.adopt`'s contract, which the
tests check). Lookups are kept only for a policy that learns from them, and
a lookup equal to the last one kept is not kept again (the adaptive policy
sees such a repeat once anyway). A `clear` drops what is left to adopt.
Anything else it is asked (insert, evict, remove, and its views) first
finishes the adoption at once, on the caller's time, as does a backlog of
more than `MAX_KEPT_KEYS` kept keys. In the daemon that is rare: a pool
adopted warm holds stores (the only inserts and evictions) for two job
timeouts, and the daemon's idle turns are enough to finish a million
blocks in about a second; a daemon never idle for a millisecond finishes it
at its first store after that, or after a million kept keys.

Once done, it hands the index its policy back (`done`), and passes every
call straight on should anyone still hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

from kvd.core.index.policies.base import CachePolicy, Key

ADOPT_SLICE = 8192  # blocks a `settle` adopts: about 8 ms of the adaptive policy's work
MAX_KEPT_KEYS = 1 << 20  # lookups and touches kept before the adoption is finished at once


class AdoptingPolicy(CachePolicy):
    """`policy` with `keys[i]` in `slots[i]` (oldest store first) still to adopt."""

    def __init__(
        self,
        policy: CachePolicy,
        slots: list[int],
        keys: list[Key],
        done: Callable[[CachePolicy], None],
    ) -> None:
        super().__init__(policy.capacity, policy._is_ready, policy._is_evictable)
        self.name = policy.name
        self.policy = policy
        self._slots = slots  # the index's lists, read only: not copied
        self._keys = keys
        self._at = 0  # slots[:_at] are adopted
        self._kept: list[tuple[bool, Sequence[int] | Sequence[Key]]] = []  # (is_touch, batch)
        self._num_kept_keys = 0
        self._last_lookup: list[Key] | None = None  # the last lookup kept
        # Only a policy that overrides the hook learns from lookups.
        self._learns = type(policy).record_lookup is not CachePolicy.record_lookup
        self._done = done

    @property
    def adopting(self) -> bool:
        return self._at < len(self._slots) or bool(self._kept)

    def finish(self) -> CachePolicy:
        """Adopts the rest, replays what was kept, hands the policy back; returns it."""
        while self._step():
            pass
        return self.policy

    def _step(self) -> bool:
        """One slice; True while more remains."""
        policy, at = self.policy, self._at
        if at < len(self._slots):
            end = at + ADOPT_SLICE
            policy.adopt(self._slots[at:end], self._keys[at:end])
            self._at = min(end, len(self._slots))
            if self._at < len(self._slots):
                return True
        if self._slots:  # the last slice is in: what was kept, then the policy back
            kept, self._kept, self._num_kept_keys = self._kept, [], 0
            self._last_lookup = None
            self._slots, self._keys = [], []
            for is_touch, batch in kept:
                if is_touch:
                    policy.touch(batch)  # type: ignore[arg-type]
                else:
                    policy.record_lookup(batch)  # type: ignore[arg-type]
            self._done(policy)
        return False

    def _keep(self, is_touch: bool, batch: Sequence[int] | Sequence[Key]) -> None:
        self._kept.append((is_touch, batch))
        self._num_kept_keys += len(batch)
        if self._num_kept_keys > MAX_KEPT_KEYS:
            self.finish()

    # -- what it keeps while adopting -------------------------------------------

    def record_lookup(self, keys: Sequence[Key]) -> None:
        if not self.adopting:
            self.policy.record_lookup(keys)
        elif self._learns:
            lookup = list(keys)
            if lookup != self._last_lookup:
                self._last_lookup = lookup
                self._keep(False, lookup)

    def touch(self, slots: Iterable[int]) -> None:
        if self.adopting:
            self._keep(True, list(slots))
        else:
            self.policy.touch(slots)

    def settle(self) -> bool:
        if self.adopting:
            return self._step() or self.policy.has_idle_work()
        return self.policy.settle()

    def has_idle_work(self) -> bool:
        return self.adopting or self.policy.has_idle_work()

    # -- everything else finishes first -------------------------------------------

    def get(self, slot: int) -> bool:
        return self.finish().get(slot)

    def adopt(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self.finish().adopt(slots, keys)

    def insert(self, slots: Sequence[int], keys: Sequence[Key]) -> None:
        self.finish().insert(slots, keys)

    def remove(self, slots: Iterable[int]) -> None:
        self.finish().remove(slots)

    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        return self.finish().evict(n, protected)

    def clear(self) -> None:
        """Every block gone (the pool reset): nothing left to adopt or replay."""
        self._slots, self._keys, self._at = [], [], 0
        self._kept, self._num_kept_keys, self._last_lookup = [], 0, None
        self.policy.clear()
        self._done(self.policy)

    def __len__(self) -> int:
        return len(self.finish())

    def slots(self) -> Iterator[int]:
        return self.finish().slots()

    def check_invariants(self) -> list[str]:
        return self.finish().check_invariants()
