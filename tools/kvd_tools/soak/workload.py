"""Runs in the soak harness and its client processes: the pool, layout and keys they share.

One pool holds everything, so the scheduler-only actors' churn evicts the
TP=2 engine's blocks and every load races with evictions. The two groups
draw keys from disjoint spaces: actors mark blocks ready without writing
them, so only the engine's own keys may be loaded and verified. The
engine's id also has workers on a second pool (`TWIN_POOL`, the twin
process), with keys of their own.

    key = prefix (1 byte: b"S" actor, b"E" engine, b"T" twin) + 8-byte big-endian int

Engine keys 0 .. ENGINE_KEYS - 1 are the engine's own; the TIMEOUT_KEYS
after them are stored only by the timeout scheduler's stores that time out,
and loaded by the engine after each (`kvd_tools.soak.timeout_scheduler`).

An engine block's bytes are a function of its key and the rank that holds
its shard (`kvd_tools.soak.engine.content`), so any load can be checked.
"""

from __future__ import annotations

from kvd_client.protocol import Layout

POOL = "soak"
TWIN_POOL = "soak-twin"
ENGINE_ID = "soak-engine"
WORLD_SIZE = 2
SLOT_BYTES = 4096  # per rank and block: 512 int64 elements
ELEMS = SLOT_BYTES // 8
# 4 MiB of rows of 2 x 4 KiB: 512 blocks, far fewer than the keys in play.
CAPACITY_BYTES = 4 << 20
ACTOR_KEYS = 2_000
ENGINE_KEYS = 600
MAX_ACTOR_CHAIN = 16
MAX_ENGINE_CHAIN = 8
NUM_DEVICE_BLOCKS = 2 * MAX_ENGINE_CHAIN
# Keys only the timeout scheduler stores (in a daemon stall) and the engine then
# loads: engine keys past ENGINE_KEYS, absent when stored, so that the store has a job.
TIMEOUT_KEYS = 200
# The twin's pool: 128 blocks for 400 keys, so its loads race with evictions too.
TWIN_CAPACITY_BYTES = 1 << 20
TWIN_KEYS = 400
# Content tags of twin blocks start past every engine block's (`kvd_tools.soak.rank.content`).
TWIN_TAG = 10 * ENGINE_KEYS


def layout() -> Layout:
    """The layout every soak client attaches with (sharded, TP=2)."""
    return Layout("soak-model@1", "int64", 16, WORLD_SIZE, False, SLOT_BYTES)


def actor_key(n: int) -> bytes:
    return b"S" + (n % ACTOR_KEYS).to_bytes(8, "big")


def engine_key(n: int) -> bytes:
    return b"E" + (n % ENGINE_KEYS).to_bytes(8, "big")


def timeout_key(n: int) -> bytes:
    """An engine key (same prefix, same content rule) that the engine's own steps never pick."""
    return b"E" + (ENGINE_KEYS + n % TIMEOUT_KEYS).to_bytes(8, "big")


def twin_key(n: int) -> bytes:
    return b"T" + (n % TWIN_KEYS).to_bytes(8, "big")


def key_number(key: bytes) -> int:
    """The int an `actor_key` or `engine_key` was made from."""
    return int.from_bytes(key[1:], "big")
