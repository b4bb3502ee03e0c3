"""Runs in the engine's processes: block keys as the wire carries them, in bounded requests."""

from __future__ import annotations

from collections.abc import Sequence

KeyLike = bytes | int
# Keys a request carries at most: the daemon takes MAX_KEYS_PER_REQUEST, but one of
# 8,192 is answered well within a client's timeout (a store's prepare costs about
# 10 us a key), and other sessions wait no longer than that for the daemon's loop.
# Longer lists go in several.
PART_KEYS = 8_192


def as_keys(keys: Sequence[KeyLike]) -> list[bytes]:
    """Block hashes as bytes; ints are sent as 8-byte big-endian (SPEC section 3).

    A list that starts with bytes is sent as it is (the hot path); the daemon's
    schema rejects a wrong element with BAD_REQUEST.
    """
    if type(keys) is list and keys and type(keys[0]) is bytes:
        return keys
    return [
        k if isinstance(k, bytes) else (k & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big") for k in keys
    ]


def parts(keys: list[bytes]) -> list[list[bytes]]:
    """`keys` in requests of at most PART_KEYS keys."""
    n = PART_KEYS
    return [keys] if len(keys) <= n else [keys[i : i + n] for i in range(0, len(keys), n)]
