"""Runs in the daemon (pure core): who prepared which store and who pinned which block.

`OwnedIndex` wraps one pool's `BlockIndex` with the ownership rules of SPEC
sections 7 and 11: only the owner that prepared a store may complete it, load
references are counted per owner, an account (a session) may hold at most
`pin_cap` pinned blocks, and `release(owner)` rolls an owner back (its
in-flight stores fail, its load references are dropped). `hold(owner, until)`
rolls it back later instead: its slots stay in flight or pinned, so nothing
reuses them while a copy the owner started may still run, until
`release_due(now)` passes `until`.

Owners are opaque hashables: a session id for the index verbs a scheduler calls
directly, a job token for the stores and loads of a transfer job (so a job can
outlive the session that started it until every rank has stopped copying).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

from kvd.core.index import BlockIndex, Key, LoadStoreSpec, PrepareStoreOutput
from kvd.errors import NotOwner, PinLimit

Owner = Hashable


class OwnedIndex:
    def __init__(self, index: BlockIndex, pin_cap: int) -> None:
        self.index = index
        self.pin_cap = pin_cap
        self._store_owner: dict[Key, Owner] = {}
        self._stores_of: dict[Owner, set[Key]] = {}
        self._pins_of: dict[Owner, Counter[Key]] = {}
        self._account_of: dict[Owner, Hashable] = {}
        self._pinned_by_account: Counter[Hashable] = Counter()
        self._held: dict[Owner, float] = {}  # owner -> when its rollback is due

    def prepare_load(self, owner: Owner, keys: Sequence[Key], account: Hashable) -> LoadStoreSpec:
        """Pins `keys` for `owner`, charged to `account`; `PinLimit` past the cap."""
        if self._pinned_by_account[account] + len(keys) > self.pin_cap:
            raise PinLimit(
                f"session would pin {self._pinned_by_account[account] + len(keys)} blocks; "
                f"the per-session cap is {self.pin_cap}"
            )
        spec = self.index.prepare_load(keys)
        if keys:  # no entry for an empty batch: release() would never drop it
            self._pins_of.setdefault(owner, Counter()).update(keys)
            self._account_of[owner] = account
            self._pinned_by_account[account] += len(keys)
        return spec

    def complete_load(self, owner: Owner, keys: Sequence[Key]) -> None:
        """Drops `owner`'s references; `NotOwner` if it holds fewer than asked."""
        held = self._pins_of.get(owner, Counter())
        for key, count in Counter(keys).items():
            if held[key] < count:
                raise NotOwner(f"this session holds no load reference on key {key.hex()}")
        self.index.complete_load(keys)
        if keys:  # an empty batch from an owner that holds nothing is a no-op
            self._unpin(owner, keys)

    def prepare_store(self, owner: Owner, keys: Sequence[Key]) -> PrepareStoreOutput | None:
        out = self.index.prepare_store(keys)
        if out is None:
            return None
        if out.keys_to_store:
            mine = self._stores_of.setdefault(owner, set())
            for key in out.keys_to_store:
                self._store_owner[key] = owner
                mine.add(key)
        for key in out.evicted_keys:
            self._forget_store(key)
        return out

    def complete_store(self, owner: Owner, keys: Sequence[Key], success: bool = True) -> None:
        """Completes `owner`'s in-flight stores; `NotOwner` for another owner's."""
        index = self.index
        for key in keys:
            if key in index and not index.is_ready(key) and self._store_owner.get(key) != owner:
                raise NotOwner(f"key {key.hex()} is being stored by another session")
        index.complete_store(keys, success)
        for key in keys:
            if self._store_owner.get(key) == owner:
                self._forget_store(key)

    def release(self, owner: Owner) -> tuple[int, int]:
        """Rolls `owner` back: fails its in-flight stores, drops its pins.

        Returns (stores failed, references dropped).
        """
        self._held.pop(owner, None)
        stores = self._stores_of.pop(owner, set())
        for key in stores:
            del self._store_owner[key]
        if stores:
            self.index.complete_store(list(stores), success=False)
        pins = self._pins_of.get(owner)
        num_refs = 0
        if pins:
            keys = list(pins.elements())
            num_refs = len(keys)
            self.index.complete_load(keys)
            self._unpin(owner, keys)
        return len(stores), num_refs

    def hold_pins(self, owner: Owner, keys: Sequence[Key], until: float) -> None:
        """Pins `keys` for `owner`, past any cap, and schedules their release for
        `until`: the blocks a load job of the dead daemon may still read (SPEC 13)."""
        if not keys:
            return
        self.index.prepare_load(keys)
        self._pins_of.setdefault(owner, Counter()).update(keys)
        self._account_of[owner] = owner
        self._pinned_by_account[owner] += len(keys)
        self._held[owner] = until

    def hold(self, owner: Owner, until: float) -> bool:
        """Schedules `owner`'s rollback for `until`; False (nothing to do) if it holds nothing."""
        if owner not in self._stores_of and owner not in self._pins_of:
            return False
        self._held[owner] = until
        return True

    def release_due(self, now: float) -> list[tuple[Owner, int, int]]:
        """Rolls back every held owner whose time came: (owner, stores failed, refs dropped)."""
        due = [owner for owner, until in self._held.items() if until <= now]
        done = []
        for owner in due:
            del self._held[owner]
            done.append((owner, *self.release(owner)))
        return done

    @property
    def num_held(self) -> int:
        return len(self._held)

    def pinned_by(self, account: Hashable) -> int:
        return self._pinned_by_account[account]

    def owners(self) -> set[Owner]:
        return set(self._stores_of) | set(self._pins_of)

    def reset(self) -> None:
        self.index.reset()
        self._store_owner.clear()
        self._stores_of.clear()
        self._pins_of.clear()
        self._account_of.clear()
        self._pinned_by_account.clear()
        self._held.clear()

    def _forget_store(self, key: Key) -> None:
        owner = self._store_owner.pop(key, None)
        if owner is not None:
            mine = self._stores_of[owner]
            mine.discard(key)
            if not mine:
                del self._stores_of[owner]

    def _unpin(self, owner: Owner, keys: Sequence[Key]) -> None:
        held = self._pins_of[owner]
        held.subtract(keys)
        for key in set(keys):
            if held[key] <= 0:
                del held[key]
        account = self._account_of[owner]
        self._pinned_by_account[account] -= len(keys)
        if self._pinned_by_account[account] <= 0:
            del self._pinned_by_account[account]
        if not held:
            del self._pins_of[owner]
            del self._account_of[owner]
