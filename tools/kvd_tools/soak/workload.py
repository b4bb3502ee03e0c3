"""Runs in the soak harness and its client processes: the pool, layout and keys they share.

One pool holds everything, so the scheduler-only actors' churn evicts the
TP=2 engine's blocks and every load races with evictions. The two groups
draw keys from disjoint spaces: actors mark blocks ready without writing
them, so only the engine's own keys may be loaded and verified.

    key = prefix (1 byte: b"S" actor, b"E" engine) + 8-byte big-endian int

An engine block's bytes are a function of its key and the rank that holds
its shard (`kvd_tools.soak.engine.content`), so any load can be checked.
"""

from __future__ import annotations

from kvd_client.protocol import Layout

POOL = "soak"
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


def layout() -> Layout:
    """The layout every soak client attaches with (sharded, TP=2)."""
    return Layout("soak-model@1", "int64", 16, WORLD_SIZE, False, SLOT_BYTES)


def actor_key(n: int) -> bytes:
    return b"S" + (n % ACTOR_KEYS).to_bytes(8, "big")


def engine_key(n: int) -> bytes:
    return b"E" + (n % ENGINE_KEYS).to_bytes(8, "big")


def key_number(key: bytes) -> int:
    """The int an `actor_key` or `engine_key` was made from."""
    return int.from_bytes(key[1:], "big")
