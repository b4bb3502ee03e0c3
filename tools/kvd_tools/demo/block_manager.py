"""Runs in the demo's scheduler process: device block ids and the block hashes kvd keys by.

Pure: no torch, no sockets. A key names a block *and everything before it*:

    root = sha256(model identity | salt)[:16]
    h_0  = sha256(root | tokens of block 0)[:16]
    h_i  = sha256(h_{i-1} | tokens of block i)[:16]     (tokens as int32 LE)

so two prompts share key i only when they share the whole prefix up to block
i, and two models (or cache salts) never share a key. Only full blocks get a
key: a partial last block is recomputed, never cached.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16


def root_hash(model_identity: str, salt: bytes = b"") -> bytes:
    """The chain's parent for block 0: the model and an optional cache salt."""
    return hashlib.sha256(model_identity.encode() + b"|" + salt).digest()[:KEY_BYTES]


def block_hashes(tokens: Sequence[int], block_tokens: int, root: bytes) -> list[bytes]:
    """The key of every full block of `tokens`, in order (a hash chain from `root`)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    keys: list[bytes] = []
    parent = root
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens : (i + 1) * block_tokens]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_tokens}i", *block)).digest()
        parent = parent[:KEY_BYTES]
        keys.append(parent)
    return keys


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """Device blocks that hold `num_tokens` tokens."""
    return (num_tokens + block_tokens - 1) // block_tokens


class BlockAllocator:
    """The device KV cache's block ids, handed out to requests and given back.

    `allocate` takes the lowest free ids (so runs of consecutive ids, which kvd
    copies in one piece, are common) and returns `None` without taking any when
    too few are free; `free` gives ids back and raises on an id that is not
    allocated, so a double free shows at once.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = set(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = sorted(self._free)[:n]
        self._free.difference_update(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if i in self._free or not 0 <= i < self.num_blocks]
        if bad:
            raise ValueError(f"device blocks {bad} are not allocated")
        self._free.update(ids)
