"""Runs in the operator's shell: reading Mooncake-format traces and replaying them
through the real `BlockIndex`, as an inference engine would drive it.

A trace is JSONL, one request per line; `hash_ids` are the request's prefix
blocks (equal ids mean an equal prefix up to that block). Per request:

    hits = lookup(keys)              leading blocks cached; stops at the first miss
    touch(keys[:hits])               the engine uses the hits
    prepare_store(keys)              allocate the rest; present keys are skipped
    complete_store(keys_to_store)    the copy finished; None above = store skipped

The hit rate is leading-prefix hits over all block references.

`prepare_store` gets the whole request, not `keys[hits:]`: the keys of the
call are protected from eviction, and an engine is loading its hits (pinned)
while it stores the rest, so evicting them to make room would be wrong. It
is also what makes Belady's optimum (`kvd_tools.bench.belady`, which never evicts a
block of the current request) an upper bound. On the Mooncake trace both
give the same hit rates.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvd.core.index import BlockIndex
from kvd_tools.bench.suites import SuiteError

Request = list[int]


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """What one replay counted."""

    num_hits: int
    num_refs: int
    num_skipped_stores: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_refs if self.num_refs else 0.0


def load_trace(path: Path) -> list[Request]:
    """The `hash_ids` of every request of a JSONL trace, in order.

    Raises `SuiteError` for a missing file, a line that is not JSON, or
    `hash_ids` that are not a list of ints in [0, 2**64).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SuiteError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    requests: list[Request] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)["hash_ids"]
        except (ValueError, KeyError, TypeError):
            raise SuiteError(f"{path}:{number}: not a JSON object with hash_ids") from None
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < 1 << 64 for i in ids):
            raise SuiteError(f"{path}:{number}: hash_ids must be a list of ints in [0, 2**64)")
        requests.append(ids)
    return requests


def replay(requests: Sequence[Sequence[int]], capacity: int, policy: str) -> ReplayStats:
    """Replays `requests` through a `BlockIndex(capacity, policy)`; see the module doc."""
    index = BlockIndex(capacity, policy)
    num_hits = num_refs = num_skipped = 0
    for ids in requests:
        keys = [i.to_bytes(8, "big") for i in ids]
        hits = index.lookup(keys)
        assert hits is not None, "every store completes before the next request"
        index.touch(keys[:hits])
        out = index.prepare_store(keys)
        if out is None:
            num_skipped += 1
        elif out.keys_to_store:
            index.complete_store(out.keys_to_store)
        index.take_events()
        num_hits += hits
        num_refs += len(keys)
    return ReplayStats(num_hits, num_refs, num_skipped)
