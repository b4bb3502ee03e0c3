"""Runs in SGLang's scheduler processes: SGLang's page hashes as kvd keys.

SGLang names a page by the hex SHA-256 of its tokens chained to the page
before (`sglang.srt.mem_cache.utils.get_hash_str`), 64 characters; kvd keys
are 1 to 64 bytes (SPEC section 3). A hex hash becomes its 32 bytes; any
other string (a backend-specific suffix, a hash of another length) the
SHA-256 of its UTF-8 bytes, so every key is 32 bytes and two different
names never meet but by a SHA-256 collision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_BYTES = 32
_HEX = frozenset("0123456789abcdefABCDEF")


def kvd_key(name: str) -> bytes:
    if len(name) == 2 * KEY_BYTES and _HEX.issuperset(name):
        return bytes.fromhex(name)
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()


def kvd_keys(names: Sequence[str]) -> list[bytes]:
    return [kvd_key(n) for n in names]
