"""Runs in the operator's shell: `kvd bench index`, the block index's cost per key and per block.

For each size and each policy of `kvd.index.policies.POLICIES`:

1. memory, with tracemalloc on: build a `BlockIndex`, fill it to capacity
   with batches of 64 fresh 8-byte keys (made inside the traced region, so the
   key objects count, as they do in the daemon), then run one turnover of the
   steady-state workload below (num_blocks more keys, all evicting).
   `bytes_per_block` is the traced memory after the turnover over
   `num_blocks`, less the workload's own bookkeeping. Right after the fill
   is not the steady state: under churn CPython dicts regrow to 3x their live
   entries (rounded up to a power of two), and ARC keeps ghost keys, so a
   running daemon holds more. Both figures go to stderr.
2. time, tracemalloc off, index full so every store evicts: per batch,
   `prepare_store` + `complete_store` (+ draining events) of 64 new keys,
   then `lookup` + `touch` of a probe: the resident keys of the 64-key batch
   of a resident key drawn at random from the whole index, as fresh key
   objects like keys off the wire. Each is timed alone with `perf_counter`,
   for at least --min-batches batches and --min-seconds each, and reported
   in microseconds per key.

The SPEC section 10 bar: per-key cost O(1) (at 1,000,000 blocks at most 2x
the cost at 10,000) and at most 300 bytes per block.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tracemalloc
from time import perf_counter

from kvd.bench.report import Row
from kvd.index import BlockIndex
from kvd.index.types import Key

BATCH = 64
MAX_RATIO = 2.0
MAX_BYTES_PER_BLOCK = 300.0
SEED = 0
_SMALL_INT_MAX = 256  # CPython shares ints up to this one; larger ones are allocated


def _keys(start: int, n: int) -> list[Key]:
    return [i.to_bytes(8, "big") for i in range(start, start + n)]


def _fill(index: BlockIndex) -> list[Key]:
    """Stores keys 0..num_blocks-1 in batches of 64; returns them (the stored objects)."""
    stored: list[Key] = []
    while len(stored) < index.num_blocks:
        keys = _keys(len(stored), min(BATCH, index.num_blocks - len(stored)))
        out = index.prepare_store(keys)
        assert out is not None and not out.evicted_keys, "an index below capacity must store"
        index.complete_store(out.keys_to_store)
        index.take_events()  # the daemon publishes and drops them
        stored += keys
    return stored


class Workload:
    """Steady-state traffic on a full index: stores of fresh keys that evict, and
    lookups of resident prefixes.

    A probe is the resident part of the batch (a "request" of 64 consecutive
    keys) of a resident key drawn at random, as fresh key objects, the way keys
    arrive from the wire. The workload keeps its own list of resident keys,
    updated from what `prepare_store` reports, to draw in O(1).
    """

    def __init__(self, index: BlockIndex, resident: list[Key]) -> None:
        self.index = index
        self.resident = resident
        self.position = {key: i for i, key in enumerate(resident)}
        self.rng = random.Random(SEED)
        self.next_key = 1 + max((int.from_bytes(k, "big") for k in resident), default=-1)

    def step(self) -> tuple[float, float, int]:
        """One batch: seconds storing 64 keys, seconds looking up and touching the
        probe, and the number of keys probed."""
        index = self.index
        keys = _keys(self.next_key, BATCH)
        self.next_key += BATCH
        t0 = perf_counter()
        out = index.prepare_store(keys)
        assert out is not None, "a full index of unpinned ready blocks can always evict"
        index.complete_store(out.keys_to_store)
        index.take_events()
        store_s = perf_counter() - t0
        self._account(out.keys_to_store, out.evicted_keys)

        drawn = int.from_bytes(self.rng.choice(self.resident), "big")
        probe = [k for k in _keys(drawn - drawn % BATCH, BATCH) if k in self.position]
        t0 = perf_counter()
        hits = index.lookup(probe)
        index.touch(probe)
        lookup_s = perf_counter() - t0
        assert hits == len(probe), "every probed key is resident and ready"
        return store_s, lookup_s, len(probe)

    def _account(self, stored: list[Key], evicted: list[Key]) -> None:
        resident, position = self.resident, self.position
        for key in evicted:
            i = position.pop(key)
            last = resident.pop()
            if i < len(resident):
                resident[i] = last
                position[last] = i
        for key in stored:
            position[key] = len(resident)
            resident.append(key)

    def overhead_bytes(self) -> int:
        """What the workload's own bookkeeping holds (the keys belong to the index):
        its list, its dict and the dict's int values (those above the small-int cache)."""
        ints = sum(sys.getsizeof(i) for i in self.position.values() if i > _SMALL_INT_MAX)
        return sys.getsizeof(self.resident) + sys.getsizeof(self.position) + ints


def _memory(num_blocks: int, policy: str) -> tuple[Workload, float, float]:
    """A full index in steady state, and its traced bytes per block after the fill
    and after one turnover (num_blocks more keys stored, with lookups)."""
    gc.collect()
    tracemalloc.start()
    try:
        index = BlockIndex(num_blocks, policy)
        workload = Workload(index, _fill(index))
        gc.collect()
        after_fill = tracemalloc.get_traced_memory()[0] - workload.overhead_bytes()
        for _ in range(-(-num_blocks // BATCH)):
            workload.step()
        gc.collect()
        steady = tracemalloc.get_traced_memory()[0] - workload.overhead_bytes()
    finally:
        tracemalloc.stop()
    return workload, after_fill / num_blocks, steady / num_blocks


def measure(num_blocks: int, policy: str, min_batches: int, min_seconds: float) -> Row:
    """One row of the suite: one size, one policy."""
    workload, fill_bytes, steady_bytes = _memory(num_blocks, policy)
    print(
        f"index: {num_blocks} blocks, {policy}: {fill_bytes:.1f} bytes per block after the "
        f"fill, {steady_bytes:.1f} after one turnover",
        file=sys.stderr,
        flush=True,
    )
    store_s = lookup_s = 0.0
    num_batches = num_probed = 0
    while num_batches < min_batches or min(store_s, lookup_s) < min_seconds:
        step_store, step_lookup, step_probed = workload.step()
        store_s += step_store
        lookup_s += step_lookup
        num_probed += step_probed
        num_batches += 1
    return {
        "num_blocks": num_blocks,
        "policy": policy,
        "us_per_key_prepare_store": round(store_s * 1e6 / (num_batches * BATCH), 3),
        "us_per_key_lookup": round(lookup_s * 1e6 / max(num_probed, 1), 3),
        "bytes_per_block": round(steady_bytes, 1),
    }


def run(args: argparse.Namespace) -> list[Row]:
    from kvd.index.policies import POLICIES

    rows: list[Row] = []
    for num_blocks in args.sizes:
        for policy in POLICIES:
            rows.append(measure(num_blocks, policy, args.min_batches, args.min_seconds))
    return rows


def _number(row: Row, field: str) -> float:
    value = row[field]
    assert isinstance(value, int | float)
    return float(value)


def summarize(rows: list[Row]) -> list[str]:
    """The bar: per-key cost at the largest size over the smallest, and bytes per block."""
    sizes = sorted({int(_number(row, "num_blocks")) for row in rows})
    small, large = sizes[0], sizes[-1]
    lines: list[str] = []
    verdicts: list[bool] = []
    for policy in dict.fromkeys(str(row["policy"]) for row in rows):
        by_size = {int(_number(r, "num_blocks")): r for r in rows if r["policy"] == policy}
        top = by_size[large]
        if small != large:
            ratios = {
                name: _number(top, f"us_per_key_{name}")
                / _number(by_size[small], f"us_per_key_{name}")
                for name in ("prepare_store", "lookup")
            }
            ok = all(r <= MAX_RATIO for r in ratios.values())
            verdicts.append(ok)
            lines.append(
                f"- {policy}: per-key cost at {large} vs {small} blocks: "
                f"prepare_store {ratios['prepare_store']:.2f}x, lookup {ratios['lookup']:.2f}x "
                f"(bar <= {MAX_RATIO:g}x): {'met' if ok else 'NOT met'}"
            )
        size_ok = _number(top, "bytes_per_block") <= MAX_BYTES_PER_BLOCK
        verdicts.append(size_ok)
        lines.append(
            f"- {policy}: {_number(top, 'bytes_per_block'):.1f} bytes per block at {large} blocks "
            f"(bar <= {MAX_BYTES_PER_BLOCK:g}): {'met' if size_ok else 'NOT met'}"
        )
    if small == large:
        lines.append(f"- one size only ({large} blocks): no scaling ratio")
    lines.append(f"Bars {'all met' if all(verdicts) else 'NOT all met'}.")
    return lines
